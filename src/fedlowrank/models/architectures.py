"""A model ladder without downloads: public architecture configs with random weights (``task.model = "arch:NAME"``).

Each entry of :data:`ARCHITECTURES` is a real transformers config class with the public hyper-parameters of a
released model (from its ``config.json`` on the Hugging Face hub) and nothing else: no weights. Such a model
measures **speed and memory only** — its weights are random, so a run with it skips evaluation (one line says
so) and ``compare``/``tune``, which only report quality, refuse it (:func:`check_measures_quality`).

``task.model`` syntax: ``arch:NAME`` or ``arch:NAME@TOKENIZER``, where TOKENIZER is ``bytes`` (default: the
bundled byte-level tokenizer of the tiny models, 259 tokens), a bundled causal LM (``smollm2-135m``: SmolLM2's
49,152-token BPE, the realistic choice for token counts; ``tiny-llama``) or a folder holding tokenizer files.
The tokenizer's ids are the model's ids (its vocabulary must fit in the model's embedding table); the config's
pad/bos/eos ids are set to the tokenizer's.

Nothing is allocated until a model is built: :func:`architecture_config` makes a config object only and
:func:`parameter_count` instantiates on the ``meta`` device, so an 8B entry can be listed and estimated anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .bundled import BUNDLED_FOLDERS, TOKENIZER_FILES, smollm2_tokenizer, tiny_tokenizer

PREFIX = "arch:"
DEFAULT_TOKENIZER = "bytes"
SPEED_AND_MEMORY_ONLY = "random weights: it measures speed and memory only"


@dataclass(frozen=True)
class Architecture:
    """A released model's architecture: ``config_class`` of transformers with ``params`` (public values).

    Attributes:
        name: the ``arch:`` name.
        model: the released model whose ``config.json`` gave the values.
        config_class: transformers config class name (``LlamaConfig``, ``Qwen2Config``).
        params: its keyword arguments.
        parameters: the released model's parameter count (checked against the built config in the tests).
    """

    name: str
    model: str
    config_class: str
    params: dict[str, Any]
    parameters: int


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}), 134_515_008),
    Architecture("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 494_032_768),
    Architecture("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={**_LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 32.0}),
        1_235_814_400),
    Architecture("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters={**_LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 8.0}),
        8_030_261_248),
)}


def is_architecture(spec: str) -> bool:
    """Whether ``task.model`` names an ``arch:`` model (random weights)."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def parse_spec(spec: str) -> tuple[Architecture, str]:
    """``"arch:NAME[@TOKENIZER]"`` → (its :class:`Architecture`, the tokenizer source); one line naming
    ``task.model`` and the allowed names otherwise."""
    name, _, tokenizer = spec[len(PREFIX):].partition("@")
    if name not in ARCHITECTURES:
        raise ValueError(f"task.model = {spec!r}: no architecture {name!r}; allowed: "
                         f"{', '.join(PREFIX + n for n in ARCHITECTURES)} (optionally @TOKENIZER: "
                         f"{DEFAULT_TOKENIZER}, smollm2-135m, tiny-llama or a folder with tokenizer files)")
    return ARCHITECTURES[name], tokenizer or DEFAULT_TOKENIZER


def architecture_config(arch: Architecture, tokenizer=None):
    """The transformers config of ``arch`` (no weights); with ``tokenizer``, its pad/bos/eos ids."""
    import transformers

    cfg = getattr(transformers, arch.config_class)(**arch.params)
    if tokenizer is not None:
        cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = (
            tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    return cfg


def parameter_count(arch: Architecture) -> int:
    """Parameters of the built model (tied embeddings counted once), from an instance on the ``meta`` device:
    nothing is allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(architecture_config(arch))
    return sum(p.numel() for p in net.parameters())


def load_tokenizer(source: str, spec: str):
    """The tokenizer of an ``arch:`` spec: ``bytes``, a bundled causal LM's, or a folder's (``spec`` names it in
    errors)."""

    if source == DEFAULT_TOKENIZER:
        return tiny_tokenizer()
    if source == "smollm2-135m":
        return smollm2_tokenizer()  # from the GGUF: no need to dequantise the model
    from transformers import AutoTokenizer

    if source in BUNDLED_FOLDERS and source != "minilm":
        return AutoTokenizer.from_pretrained(BUNDLED_FOLDERS[source]())
    folder = Path(source).expanduser()
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"task.model = {spec!r}: tokenizer {source!r} is neither {DEFAULT_TOKENIZER!r}, a bundled "
                         f"causal LM (smollm2-135m, tiny-llama) nor a folder with tokenizer files")
    return AutoTokenizer.from_pretrained(str(folder))


def build_architecture(spec: str, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
    """``arch:NAME[@TOKENIZER]`` → (a ``*ForCausalLM`` with random weights drawn after ``torch.manual_seed(0)``,
    built directly on ``device`` in ``dtype``, eval mode; its tokenizer)."""
    from transformers import AutoModelForCausalLM

    arch, source = parse_spec(spec)
    tokenizer = load_tokenizer(source, spec)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > arch.params["vocab_size"]:
        raise ValueError(f"task.model = {spec!r}: the tokenizer has {len(tokenizer)} tokens, more than the "
                         f"architecture's vocabulary of {arch.params['vocab_size']}")
    torch.manual_seed(0)
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(architecture_config(arch, tokenizer), dtype=dtype)
    net.config.name_or_path = spec
    return net.eval(), tokenizer


def check_measures_quality(model: str, command: str) -> None:
    """``compare`` and ``tune`` report quality: refuse an ``arch:`` model (random weights) with one line."""
    if is_architecture(model):
        raise ValueError(f"task.model = {model!r} has {SPEED_AND_MEMORY_ONLY}; `fedlowrank {command}` reports "
                         f"model quality, so it needs pretrained weights (a bundled model, a folder or a hub id)")


__all__ = ["ARCHITECTURES", "Architecture", "PREFIX", "SPEED_AND_MEMORY_ONLY", "architecture_config",
           "build_architecture", "check_measures_quality", "is_architecture", "parameter_count", "parse_spec"]
