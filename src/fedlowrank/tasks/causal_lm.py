"""Instruction tuning of a causal language model (``task.kind = "causal-lm"``), e.g. SmolLM2 on GSM8K.

* **Formatting**: the prompt is the user turn of the model's chat template (with the generation prompt) when its
  tokenizer has one, else the plain template ``"Question: {prompt}\\nAnswer: "``; the response follows as
  ``tokens(response) + [eos]``. The loss is on the response tokens only: prompt and padding labels are -100.
* **Truncation** at ``task.max_length`` tokens keeps the start; the examples cut, and those whose response was
  cut entirely (no loss tokens left), are counted in :meth:`CausalLM.describe` and logged.
* **Batches** are padded on the right to the batch's longest example (dynamic padding).
* **Evaluation**: token loss and perplexity on the responses of a fixed seeded subset of the test split
  (``eval_examples``), and, when ``eval_generate`` > 0, the exact match of the final number of greedy generations
  (batched with left padding and the KV cache, ``max_new_tokens``, stopping at EOS) on a fixed seeded subset of
  that many questions; the first ``write_generations`` of them are handed to the runtime for the run directory.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.model import AdaptedModel
from ..device import module_device
from ..models.architectures import SPEED_AND_MEMORY_ONLY
from ..schema import Schema, setting
from ..seeding import numpy_rng
from . import register_task
from .base import Task, adapted_copy, check_max_length, join_padded
from .instructions import InstructionData

log = logging.getLogger("fedlowrank")

PLAIN_TEMPLATE = "Question: {prompt}\nAnswer: "
IGNORE = -100  # label of a token that carries no loss

# A number: optional minus (not after a word character, so "3-5" ends in 5), digits with optional thousands
# commas, optional decimals.
_NUMBER = re.compile(r"(?<![\w.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    """``"1,234"`` → ``"1234"``, ``"3.50"`` → ``"3.5"``, ``"-0"`` → ``"0"``; ``None`` if ``text`` is no number."""
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final number of a solution, normalised (:func:`normalize_number`): the first number after the last
    ``####`` when there is one (GSM8K's reference format), else the last number in the text; ``None`` if none."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        return normalize_number(found[0]) if found else None
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


@dataclass
class Encoded:
    """One tokenised example: ``ids`` (prompt then response + eos, at most ``max_length``), the prompt's length
    within ``ids``, whether it was truncated and whether its whole response was cut."""

    ids: list[int]
    prompt_len: int
    truncated: bool

    @property
    def lost_response(self) -> bool:
        return self.prompt_len >= len(self.ids)


def uses_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The tokens of the prompt: the chat template's user turn plus the assistant's generation prompt, or the
    plain template (with the tokenizer's own special tokens, e.g. BOS)."""
    if uses_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(PLAIN_TEMPLATE.format(prompt=prompt))["input_ids"])


def encode_example(tokenizer, prompt: str, response: str, max_length: int) -> Encoded:
    """Prompt tokens, then ``tokens(response) + [eos]``, cut to ``max_length``."""
    p = prompt_ids(tokenizer, prompt)
    r = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    ids = p + r
    return Encoded(ids[:max_length], min(len(p), max_length), len(ids) > max_length)


def collate(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on prompt and padding), each
    ``[B, T]`` with T the longest example."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        mask[i, :n] = 1
        labels[i, e.prompt_len:n] = torch.tensor(e.ids[e.prompt_len:], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, T] ids, [B, T] mask)`` padded on the left (for generation)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def response_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token negative log-likelihood over labelled positions and their count.

    ``logits: [B, T, V]`` predicts token t+1 at position t; ``labels: [B, T]`` with -100 where there is no loss.
    """
    target = labels[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE,
                          reduction="sum")
    return nll, int((target != IGNORE).sum())


@torch.no_grad()
def generate(net: nn.Module, tokenizer, prompts: list[list[int]], max_new_tokens: int,
             batch_size: int = 8) -> list[list[int]]:
    """Greedy continuations of tokenised prompts: batches of ``batch_size``, left padding, the KV cache, at most
    ``max_new_tokens`` each, cut at (and without) the first EOS."""
    net.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[start:start + batch_size], pad)
        dev = module_device(net)
        seq = net.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                           do_sample=False, use_cache=True, eos_token_id=eos, pad_token_id=pad,
                           temperature=None, top_p=None, top_k=None)
        for row in seq[:, ids.shape[1]:].tolist():
            out.append(row[:row.index(eos)] if eos in row else row)
    return out


MAX_NEW_TOKENS = 1 << 17


@dataclass
class CausalLMOptions(Schema):
    """``task.options`` of ``task.kind = "causal-lm"``: what is evaluated, on which fixed subsets."""

    prefix = "task.options"

    eval_examples: int = setting(200, "size of the fixed test subset for loss and perplexity (0 = the whole test "
                                 "split)", ge=0)
    eval_generate: int = setting(0, "questions in the fixed generation subset for exact match (0 = no generation)",
                                 ge=0)
    max_new_tokens: int = setting(256, "generation budget per question", ge=1, le=MAX_NEW_TOKENS,
                                  reason="longer than any bundled model's context")
    generation_batch_size: int = setting(8, "questions generated together", ge=1)
    write_generations: int = setting(5, "generations per evaluation written to the run directory", ge=0)
    eval_seed: int = setting(0, "seed of the two evaluation subsets (fixed across runs and methods unless changed)")


@register_task
class CausalLM(Task):
    """Causal-LM instruction tuning; metrics ``loss`` and ``perplexity`` (held-out response tokens) and, with
    ``eval_generate`` > 0, ``exact_match`` of the final number.

    Args:
        data: the prompt/response pairs.
        model: ``task.model``: a bundled name (``smollm2-135m``, ``tiny-llama``...), a local folder or a hub id.
        max_length: tokens per training example (prompt + response + eos); longer examples are cut.
        targets: LoRA target modules (``lora.targets``); ``None`` = the architecture's default.
        eval_batch_size: examples per evaluation forward pass.
        eval_examples, eval_generate, max_new_tokens, generation_batch_size, write_generations, eval_seed: the
            options (``task.options``), declared with their meanings and bounds in :class:`CausalLMOptions`.
        quantize: ``task.quantize``: ``""``, or ``"4bit"``/``"8bit"`` storage of the frozen backbone (QLoRA).
    """

    name = "causal-lm"
    metrics = ("loss", "perplexity", "exact_match")
    primary_metric = "loss"
    maximize = ("exact_match",)
    supports_cohorts = True
    supports_quantize = True
    Options = CausalLMOptions
    data_description = "instruction data"
    data_sources = {"arithmetic": ("max_train_examples", "max_test_examples"),
                    "gsm8k": ("max_train_examples", "max_test_examples", "path"),
                    "files": ("max_train_examples", "max_test_examples", "train", "test", "prompt_column",
                              "response_column", "test_fraction", "header"),
                    "hf": ("max_train_examples", "max_test_examples", "hf_name", "prompt_column", "response_column",
                           "train", "test")}

    @classmethod
    def from_config(cls, cfg) -> "CausalLM":
        """Read the instruction data of ``[data]`` (with ``partition.partition_by``'s column) and tokenise it."""
        from .instructions import load_instructions

        data = load_instructions(cfg.data, cfg.partition.partition_by, cfg.run.seed)
        return cls(data, cfg.task.model, cfg.task.max_length, cfg.lora.targets or None, cfg.task.eval_batch_size,
                   quantize=cfg.task.quantize, **cfg.task.options)

    def __init__(self, data: InstructionData, model: str = "tiny-llama", max_length: int = 256,
                 targets: list[str] | None = None, eval_batch_size: int = 8,
                 eval_examples: int = CausalLMOptions.eval_examples,
                 eval_generate: int = CausalLMOptions.eval_generate,
                 max_new_tokens: int = CausalLMOptions.max_new_tokens,
                 generation_batch_size: int = CausalLMOptions.generation_batch_size,
                 write_generations: int = CausalLMOptions.write_generations,
                 eval_seed: int = CausalLMOptions.eval_seed, quantize: str = ""):
        from ..models.loading import load_model

        CausalLMOptions(eval_examples=eval_examples, eval_generate=eval_generate, max_new_tokens=max_new_tokens,
                        generation_batch_size=generation_batch_size, write_generations=write_generations,
                        eval_seed=eval_seed)  # checks each option
        self.data = data
        self.model_name = model
        self.max_length = max_length
        self.targets = targets
        self.eval_batch_size = eval_batch_size
        self.max_new_tokens = max_new_tokens
        self.generation_batch_size = generation_batch_size
        self.write_generations = write_generations
        self.loaded = load_model(model, "causal-lm", quantize=quantize)
        check_max_length(self.loaded, max_length)
        self.tokenizer = self.loaded.tokenizer
        tok = self.tokenizer
        self.train = [encode_example(tok, p, r, max_length) for p, r in zip(data.train_prompts, data.train_responses)]
        n_test = len(data.test_prompts)
        pick = numpy_rng(eval_seed, "eval-loss-subset").permutation(n_test)
        self.eval_idx = np.sort(pick[:eval_examples] if eval_examples else pick)
        evals = [encode_example(tok, data.test_prompts[i], data.test_responses[i], max_length) for i in self.eval_idx]
        order = np.argsort([len(e.ids) for e in evals], kind="stable")  # length-sorted: less padding
        self.eval_encoded = [evals[i] for i in order]
        numeric = [i for i in range(n_test) if extract_answer(data.test_responses[i]) is not None]
        pick = numpy_rng(eval_seed, "eval-generate-subset").permutation(len(numeric))[:eval_generate]
        self.generate_idx = np.sort(np.asarray(numeric, dtype=np.int64)[pick]) if eval_generate else np.zeros(0, int)
        self.metric_counts = {"exact_match": len(self.generate_idx)}
        if eval_generate and not numeric:
            raise ValueError("task.options.eval_generate: no test response has a final number to match "
                             "(GSM8K-style '#### N' or a last number); set eval_generate = 0")
        self.generation_prompts = [prompt_ids(tok, data.test_prompts[i])[-max_length:] for i in self.generate_idx]
        self._generations: list[dict[str, Any]] = []
        self._said_speed_only = False
        self.truncation = {split: {"examples": len(enc), "truncated": sum(e.truncated for e in enc),
                                   "lost_response": sum(e.lost_response for e in enc)}
                           for split, enc in (("train", self.train), ("eval", evals))}
        t = self.truncation["train"]
        if t["truncated"]:
            log.warning("causal-lm: %d of %d training examples are longer than task.max_length = %d tokens and were "
                        "truncated; %d of them lost their whole response", t["truncated"], t["examples"],
                        max_length, t["lost_response"])

    @property
    def num_train(self) -> int:
        return len(self.train)

    def column_values(self, name: str) -> list[str]:
        if name not in self.data.train_columns:
            raise ValueError(f"partition.partition_by = {name!r}: the data was read without that column")
        return self.data.train_columns[name]

    def embedding_texts(self) -> list[str]:
        return self.data.train_prompts

    def build_model(self) -> AdaptedModel:
        """A copy of the loaded model; no head is trained (``lm_head`` and the embeddings stay frozen)."""
        return adapted_copy(self.loaded, self.targets, train_outputs=False)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return collate([self.train[int(i)] for i in indices], self.tokenizer.pad_token_id)

    def _forward(self, net: nn.Module, batch: dict[str, torch.Tensor], **kwargs):
        dev = module_device(net)
        return net(input_ids=batch["input_ids"].to(dev), attention_mask=batch["attention_mask"].to(dev), **kwargs)

    def loss(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Mean next-token cross-entropy over the batch's response tokens (0 with no gradient when the batch
        has none left after truncation)."""
        return self.output_loss(self.output(net, batch), batch)

    def output(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Logits ``[B, T, V]``."""
        return self._forward(net, batch).logits

    def output_loss(self, out: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """:meth:`loss` from logits ``[B, T', V]``, ``T' ≥ T`` (the positions past the batch's own are padding)."""
        labels = batch["labels"].to(out.device)
        nll, count = response_nll(out[:, :labels.shape[1]], labels)
        return nll / max(count, 1)

    def join_batches(self, batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[slice]]:
        """Right padding as in :func:`collate`: the pad token, mask 0, label -100."""
        return join_padded(batches, {"input_ids": self.tokenizer.pad_token_id, "attention_mask": 0,
                                     "labels": IGNORE})

    def features(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """``[B, d]`` last hidden state averaged over each example's tokens (padding excluded)."""
        hidden = self._forward(net, batch, output_hidden_states=True).hidden_states[-1]
        mask = batch["attention_mask"].to(hidden.device).unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    @torch.no_grad()
    def _token_loss(self, net: nn.Module, examples: list[Encoded]) -> dict[str, float]:
        """Mean cross-entropy over the response tokens of ``examples`` (length-sorted) and its perplexity."""
        net.eval()
        total, count = 0.0, 0
        for start in range(0, len(examples), self.eval_batch_size):
            batch = collate(examples[start:start + self.eval_batch_size], self.tokenizer.pad_token_id)
            logits = self._forward(net, batch).logits
            nll, n = response_nll(logits, batch["labels"].to(logits.device))
            total, count = total + float(nll), count + n
        loss = total / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}

    def evaluate_examples(self, net: nn.Module, indices: np.ndarray) -> dict[str, float]:
        """Loss and perplexity on the training examples at ``indices`` (a validation split for tuning)."""
        return self._token_loss(net, sorted((self.train[int(i)] for i in indices), key=lambda e: len(e.ids)))

    @torch.no_grad()
    def evaluate(self, net: nn.Module) -> dict[str, float]:
        if self.loaded.speed_and_memory_only:  # random weights: no metric would mean anything
            if not self._said_speed_only:
                log.warning("causal-lm: task.model = %r has %s; evaluation skipped", self.model_name,
                            SPEED_AND_MEMORY_ONLY)
                self._said_speed_only = True
            return {}
        metrics = self._token_loss(net, self.eval_encoded)
        if len(self.generate_idx):
            outputs = generate(net, self.tokenizer, self.generation_prompts, self.max_new_tokens,
                               self.generation_batch_size)
            records = []
            for i, out in zip(self.generate_idx, outputs):
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                reference = self.data.test_responses[i]
                predicted = extract_answer(text)
                records.append({"test_index": int(i), "prompt": self.data.test_prompts[i], "reference": reference,
                                "output": text, "extracted": predicted,
                                "correct": predicted is not None and predicted == extract_answer(reference)})
            metrics["exact_match"] = sum(r["correct"] for r in records) / len(records)
            self._generations = records[:self.write_generations]
        return metrics

    def pop_generations(self) -> list[dict[str, Any]]:
        out, self._generations = self._generations, []
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model_name, "source": self.loaded.source,
                "num_train": self.num_train, "num_test": len(self.data.test_prompts),
                "template": "chat" if uses_chat_template(self.tokenizer) else "plain", "max_length": self.max_length,
                "truncation": self.truncation, "eval_examples": len(self.eval_idx),
                "eval_generate": len(self.generate_idx), "max_new_tokens": self.max_new_tokens}
