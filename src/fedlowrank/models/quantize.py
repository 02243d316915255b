"""QLoRA's frozen backbone: ``task.quantize = "4bit" | "8bit"`` stores every frozen ``nn.Linear`` quantised.

* ``"4bit"``: NF4 with blockwise absmax scales (block 64) and double quantisation of the scales, as in QLoRA
  (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314, §3); about 0.52 bytes per
  weight. The matmul and its backward dequantise the weight straight into the input's dtype, the compute dtype
  (``train.dtype``: bf16 under bf16, never through an fp32 copy of the weight; bitsandbytes' ``matmul_4bit`` with
  the quantisation state's ``dtype`` set to it).
* ``"8bit"``: LLM.int8()'s row-wise absmax int8 weights (Dettmers et al., arXiv:2208.07339, eq. 1–2) without the
  outlier decomposition (threshold 0); about 1 byte per weight.

Adapters (LoRA, the Gram adapter, base deltas) stay in the compute dtype and are trained as usual: the frozen path
of an :class:`~fedlowrank.adapters.model.AdaptedLinear` whose base is a :class:`QuantizedLinear` is the quantised
product (its backward dequantises again and keeps no dense weight), plus ``x base_deltaᵀ`` when a method holds a
base delta. Methods that read the pretrained weight (``layer.weight``: FR-LoRA's PiSSA, ILoRA's QR, export's
``W0``) get its dequantised value, ``[out, in]`` in the compute dtype, made on each access.

The output modules (``lm_head``, a classification head) and the embeddings stay unquantised. Quantisation runs
where the weights are (the CPU at build time) through bitsandbytes' backends: CUDA, and the CPU from
bitsandbytes 0.48 on. bitsandbytes is the optional extra ``fedlowrank[qlora]``; without it ``task.quantize`` is
one error line.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZE_MODES = ("", "4bit", "8bit")
MIN_BITSANDBYTES = (0, 48)


def require_bitsandbytes(mode: str) -> Any:
    """The ``bitsandbytes`` module, after quantising and multiplying a small matrix with it on the CPU (the
    backend :func:`quantize_linears` uses); one line naming ``task.quantize`` when it is missing or cannot."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"task.quantize must be one of {', '.join(repr(m) for m in QUANTIZE_MODES)}; got {mode!r}")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError(f"task.quantize = {mode!r} needs bitsandbytes: pip install 'fedlowrank[qlora]'") from None
    version = tuple(int(p) for p in bnb.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_BITSANDBYTES:
        raise ValueError(f"task.quantize = {mode!r} needs bitsandbytes >= {'.'.join(map(str, MIN_BITSANDBYTES))} "
                         f"(its CPU backend quantises the backbone); found {bnb.__version__}")
    probe = nn.Linear(64, 64)
    try:
        QuantizedLinear(probe, mode)(torch.ones(2, 64))
    except Exception as exc:  # a backend bitsandbytes could not load: say which, in one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"task.quantize = {mode!r}: bitsandbytes {bnb.__version__} cannot quantise on the CPU "
                         f"here ({reason})") from None
    return bnb


class QuantizedLinear(nn.Linear):
    """A frozen ``nn.Linear`` held in 4 or 8 bits: ``y = x Ŵᵀ + bias`` with ``Ŵ`` the dequantised weight.

    Attributes:
        mode: ``"4bit"`` or ``"8bit"``.
        compute_dtype: the dtype :attr:`weight` returns and the 4-bit weight is dequantised into: the original
            weight's until an input of another dtype arrives (``train.dtype``), then the inputs'.
        qweight: (4 bit) bitsandbytes' ``Params4bit`` (packed NF4 and its quantisation state).
        CB, SCB: (8 bit) buffers: int8 weight ``[out, in]`` and row scales ``[out]`` (``Ŵ = CB · SCB / 127``).
        bias: ``[out]`` frozen, or ``None``.
    """

    def __init__(self, linear: nn.Linear, mode: str):
        import bitsandbytes as bnb

        nn.Module.__init__(self)
        if mode not in QUANTIZE_MODES[1:]:
            raise ValueError(f"task.quantize must be '4bit' or '8bit' here; got {mode!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.mode = mode
        w = linear.weight.detach()
        self.compute_dtype = w.dtype
        if mode == "4bit":
            self.qweight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True).to(w.device)
        else:
            CB, SCB, _ = bnb.functional.int8_vectorwise_quant(w.to(torch.float16))
            self.register_buffer("CB", CB)
            self.register_buffer("SCB", SCB)
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.register_parameter("bias", bias)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The dequantised weight ``[out, in]`` in :attr:`compute_dtype` (a new tensor on each access)."""
        import bitsandbytes as bnb

        if self.mode == "4bit":
            w = bnb.functional.dequantize_4bit(self.qweight.data, self.qweight.quant_state)
        else:
            w = self.CB.to(torch.float32) * (self.SCB.to(torch.float32)[:, None] / 127.0)
        return w.to(self.compute_dtype)

    def compute_in(self, dtype: torch.dtype) -> None:
        """Dequantise into ``dtype`` from now on (:attr:`weight`, the 4-bit matmul's backward)."""
        self.compute_dtype = dtype
        if self.mode == "4bit":
            self.qweight.quant_state.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        if x.dtype != self.compute_dtype:
            self.compute_in(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.mode == "4bit":
            return bnb.matmul_4bit(x, self.qweight.t(), quant_state=self.qweight.quant_state, bias=bias)
        state = bnb.MatmulLtState()  # stateless: built from the buffers, so copies and moves need no bookkeeping
        state.has_fp16_weights, state.threshold, state.CB, state.SCB = False, 0.0, self.CB, self.SCB
        return bnb.matmul(x, self.CB, state=state, bias=bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """As a plain ``nn.Linear``: ``weight`` (dequantised) and ``bias``, so that a state dict of a quantised
        network has the keys and shapes of the unquantised one (export's merged model reads it)."""
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, QuantizedLinear)


def quantized_output(layer: QuantizedLinear, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """The frozen path of an adapted quantised layer: ``x Ŵᵀ + bias`` (+ ``x deltaᵀ`` for a base delta)."""
    y = layer(x)
    return y if delta is None else y + F.linear(x, delta.to(x.dtype))


def quantize_linears(net: nn.Module, mode: str, skip: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` of ``net`` outside the modules named in ``skip`` (and their children) by a
    :class:`QuantizedLinear` of ``mode``; returns how many. ``mode = ""`` changes nothing."""
    if not mode:
        return 0
    require_bitsandbytes(mode)
    under = tuple(f"{s}." for s in skip)
    found = [(n, m) for n, m in net.named_modules()
             if isinstance(m, nn.Linear) and not is_quantized(m) and n not in skip and not n.startswith(under)]
    for name, mod in found:
        parent, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, attr, QuantizedLinear(mod, mode))
    return len(found)


def weight_bytes(net: nn.Module) -> int:
    """Bytes of ``net``'s parameters and buffers as stored (packed quantised weights at their size)."""
    seen: set[int] = set()
    total = 0
    for t in (*net.parameters(), *net.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
            state = getattr(t, "quant_state", None)
            if state is not None:
                total += sum(x.numel() * x.element_size() for x in (state.absmax, *(
                    (state.state2.absmax, state.state2.code) if state.state2 is not None else ())))
    return total


__all__ = ["QUANTIZE_MODES", "QuantizedLinear", "is_quantized", "quantize_linears", "quantized_output",
           "require_bitsandbytes", "weight_bytes"]
