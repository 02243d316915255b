"""LoRA in one place: factors, scaling rule, dropout, initialisation.

Conventions (docs/architecture.md, "Conventions"): ``B: [out, r]``, ``A: [r, in]``, ``ΔW = s · B A`` with ``s = α / r`` (``"standard"``)
or ``s = α / √r`` (``"rslora"``). Ranks can differ per client: :meth:`LoRALinear.set_factors` resizes the
factors and recomputes ``s`` from the new rank by the same rule.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..device import stage_together
from ..schema import check_choice
from .model import AdaptedLinear, AdaptedModel

SCALING_RULES = ("standard", "rslora")


def lora_scale(alpha: float, rank: int, rule: str = "standard") -> float:
    """The LoRA scaling ``s``: ``α/r`` (standard) or ``α/√r`` (rsLoRA). The only place it is computed."""
    check_choice("lora.scaling", rule, SCALING_RULES)
    return alpha / rank if rule == "standard" else alpha / math.sqrt(rank)


def init_lora_factors(out_features: int, in_features: int, rank: int, generator: torch.Generator,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's default init: ``A ~ kaiming_uniform(a=√5)`` (``U(-1/√in, 1/√in)``), ``B = 0``.

    Returns ``(A: [r, in], B: [out, r])``.
    """
    bound = 1.0 / math.sqrt(in_features)
    a = (torch.rand(rank, in_features, generator=generator, dtype=dtype) * 2 - 1) * bound
    return a, torch.zeros(out_features, rank, dtype=dtype)


class LoRALinear(AdaptedLinear):
    """``y = x (W0 + base_delta)ᵀ + s · dropout(x) Aᵀ Bᵀ + bias``, computed in factored form."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, scaling: str = "standard", dropout: float = 0.0):
        super().__init__(base)
        if rank < 1 or rank > min(self.in_features, self.out_features):
            raise ValueError(f"lora.rank must be in [1, {min(self.in_features, self.out_features)}], got {rank}")
        self.alpha = float(alpha)
        self.scaling_rule = scaling
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))
        self.scale = lora_scale(self.alpha, rank, scaling)

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    def set_factors(self, A: torch.Tensor, B: torch.Tensor) -> None:
        """Load ``A: [r, in]``, ``B: [out, r]`` (any r); the scale follows the rank by the configured rule."""
        load_factors([self], [(A, B)])

    def _fit_rank(self, A: torch.Tensor, B: torch.Tensor) -> None:
        """Check that ``A``, ``B`` fit the layer and give it factors of their rank (where the old ones are, in
        their dtype: fp32 over a bf16 backbone)."""
        r = A.shape[0]
        if A.shape != (r, self.in_features) or B.shape != (self.out_features, r):
            raise ValueError(f"LoRA factors of shapes A{tuple(A.shape)}, B{tuple(B.shape)} do not fit a "
                             f"[{self.out_features}, {self.in_features}] layer")
        if r != self.rank:
            self.lora_A = nn.Parameter(self.lora_A.new_empty(r, self.in_features))
            self.lora_B = nn.Parameter(self.lora_B.new_empty(self.out_features, r))
            self.scale = lora_scale(self.alpha, r, self.scaling_rule)

    def adapter_delta(self) -> torch.Tensor:
        return self.scale * (self.lora_B @ self.lora_A)

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.output_map(self.input_map(self.dropout(x), self.lora_A), self.lora_B)



def load_factors(layers: Sequence[LoRALinear], factors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each layer's :meth:`LoRALinear.set_factors` of its ``(A, B)``, written together: the factors staged on the
    layers' device as one move per dtype (:func:`~fedlowrank.device.stage_together`) and copied into the layers by
    one multi-tensor copy, not one per factor."""
    for layer, (A, B) in zip(layers, factors):
        layer._fit_rank(A, B)
    targets = [p for layer in layers for p in (layer.lora_A, layer.lora_B)]
    if not targets:
        return
    with torch.no_grad():
        torch._foreach_copy_(targets, stage_together([t for pair in factors for t in pair], targets[0].device))


class LoRAStacks:
    """The LoRA factors of a cohort's ``slots`` members on every target they can share a batched product on, held
    across rounds: for each factor group (every target's ``A`` of one input size, every target's ``B`` of one
    output size) one trained tensor, ``A: [T, K, R, in]`` and ``B: [T, K, out, R]`` (T targets, K slots, R the
    largest rank). Member k's ``lora_A``/``lora_B`` of target t are views ``A[t, k, :r_k]``, ``B[t, k, :, :r_k]``
    (the directions past its rank stay zero: their gradients are zero, so no optimizer moves them), so that a
    round writes each member's factors into its slot as its method loads them (:meth:`bind` copies what was loaded
    elsewhere, e.g. factors of another rank), an optimizer over :meth:`trained` steps every member at once, and a
    step reads every target's factors from a few tensors (:meth:`prepare`, :meth:`factors`): each group cast to the
    compute dtype once, each member's scale folded into ``B``. The backward fills one gradient per group
    (:meth:`member_grad` is member k's part of a target's)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.names: list[str] = []                             # the stacked targets
        self.groups: dict[tuple[str, int], nn.Parameter] = {}   # ("A", in) / ("B", out) → the stacked factor
        self.where: dict[str, tuple[tuple[str, int], int, tuple[str, int], int]] = {}  # target → A's, B's place
        self.rank = 0
        self.scales: dict[tuple[str, int], torch.Tensor] | float = 1.0  # per B group [T, K, 1, 1], or one for all
        self._scales_of: tuple = ()
        self._owner: dict[tuple[str, int], str] = {}             # a target of each group
        self._views: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._step: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def stackable(layers: list[nn.Module]) -> bool:
        """Whether one target's ``layers`` (one per member) can be stacked: linear :class:`LoRALinear` layers
        without LoRA dropout, of one factor dtype and device, each factor trained by all of them or by none."""
        if not all(type(m) is LoRALinear and isinstance(m.base, nn.Linear) and isinstance(m.dropout, nn.Identity)
                   for m in layers):
            return False
        first = layers[0]
        return all(m.lora_A.dtype == first.lora_A.dtype == m.lora_B.dtype and m.lora_A.device == first.lora_A.device
                   and m.lora_A.requires_grad == first.lora_A.requires_grad
                   and m.lora_B.requires_grad == first.lora_B.requires_grad for m in layers)

    def bind(self, layers: dict[str, list[LoRALinear]]) -> bool:
        """Stack the members' factors of the targets in ``layers`` (target → its layer in each member's model,
        at most :attr:`slots`): each member's factors in its slot, its ``lora_A``/``lora_B`` views of it. Returns
        whether the stacked tensors were made anew (the first time, other targets or a larger rank): an optimizer
        over :meth:`trained` must then be made anew too."""
        names = [n for n, ls in layers.items() if self.stackable(ls)]
        rank = max((m.rank for n in names for m in layers[n]), default=0)
        made = names != self.names or rank > self.rank
        if made:
            self._make(names, layers, rank)
        for name in names:
            (ka, ta, kb, tb) = self.where[name]
            for k, m in enumerate(layers[name]):
                A, B = self._member_views(name, k, m.rank)
                for p, view, group, t, padded in ((m.lora_A, A, ka, ta, (slice(m.rank, None),)),
                                                  (m.lora_B, B, kb, tb, (slice(None), slice(m.rank, None)))):
                    if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                        with torch.no_grad():
                            view.copy_(p)
                            self.groups[group].detach()[t, k][padded].zero_()
                        p.data = view
        for key, group in self.groups.items():
            group.requires_grad_(getattr(layers[self._owner[key]][0], f"lora_{key[0]}").requires_grad)
        self._set_scales(names, layers)
        return made

    def _make(self, names: list[str], layers: dict[str, list[LoRALinear]], rank: int) -> None:
        first = {n: layers[n][0] for n in names}
        count: dict[tuple[str, int], int] = {}
        self.where, self._owner = {}, {}
        for n in names:
            ka, kb = ("A", first[n].in_features), ("B", first[n].out_features)
            self.where[n] = (ka, count.get(ka, 0), kb, count.get(kb, 0))
            count[ka], count[kb] = count.get(ka, 0) + 1, count.get(kb, 0) + 1
            self._owner.setdefault(ka, n)
            self._owner.setdefault(kb, n)
        like = dict(dtype=first[names[0]].lora_A.dtype, device=first[names[0]].lora_A.device) if names else {}
        self.groups = {key: nn.Parameter(torch.zeros((t, self.slots, rank, key[1]) if key[0] == "A"
                                                     else (t, self.slots, key[1], rank), **like))
                       for key, t in count.items()}
        self.names, self.rank, self._views, self._scales_of = names, rank, {}, ()

    def _member_views(self, name: str, k: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Member k's factors of target ``name`` at ``rank``, as views of the stacked tensors (made once)."""
        if (name, k, rank) not in self._views:
            ka, ta, kb, tb = self.where[name]
            self._views[name, k, rank] = (self.groups[ka].detach()[ta, k, :rank],
                                          self.groups[kb].detach()[tb, k, :, :rank])
        return self._views[name, k, rank]

    def _set_scales(self, names: list[str], layers: dict[str, list[LoRALinear]]) -> None:
        scales = tuple(tuple(m.scale for m in layers[n]) for n in names)
        if scales == self._scales_of:
            return
        self._scales_of = scales
        values = {v for row in scales for v in row}
        if len(values) == 1:
            self.scales = values.pop()
            return
        table = {key: torch.ones(group.shape[0], self.slots, 1, 1, dtype=torch.float64)
                 for key, group in self.groups.items() if key[0] == "B"}
        for n, row in zip(names, scales):
            _, _, kb, tb = self.where[n]
            table[kb][tb, :len(row), 0, 0] = torch.tensor(row, dtype=torch.float64)
        self.scales = {key: t.to(self.groups[key].dtype).to(self.groups[key].device) for key, t in table.items()}

    def trained(self) -> list[nn.Parameter]:
        """The stacked tensors some member trains (for the optimizer)."""
        return [g for g in self.groups.values() if g.requires_grad]

    def prepare(self, members: int, dtype: torch.dtype, select: torch.Tensor | None = None) -> None:
        """This step's factors (:meth:`factors`): each group's first ``members`` slots (or the slots ``select``
        ``[K']``, on the device), in ``dtype``, ``B`` times each member's scale; with autograd, so that the
        backward fills each group's gradient."""
        self._step = {}
        parts = {}
        for key, group in self.groups.items():
            g = group if select is None else group.index_select(1, select)
            if select is None and members < self.slots:
                g = g.narrow(1, 0, members)
            if key[0] == "B":
                scale = self.scales if isinstance(self.scales, float) else self.scales[key]
                if isinstance(scale, torch.Tensor):
                    scale = scale.index_select(1, select) if select is not None else scale.narrow(1, 0, members)
                g = g * scale
            parts[key] = g.to(dtype).unbind(0)
        for name in self.names:
            ka, ta, kb, tb = self.where[name]
            self._step[name] = (parts[ka][ta], parts[kb][tb])

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ``name``'s ``(A [K, R, in], s·B [K, out, R])`` of this step (:meth:`prepare`)."""
        return self._step[name]

    def member_grad(self, name: str, k: int, factor: str, rank: int) -> torch.Tensor | None:
        """Member k's part of the gradient of target ``name``'s stacked ``factor`` (``"A"`` or ``"B"``) at its
        ``rank``: a view, ``None`` before a backward."""
        ka, ta, kb, tb = self.where[name]
        grad = self.groups[ka if factor == "A" else kb].grad
        if grad is None:
            return None
        return grad[ta, k, :rank] if factor == "A" else grad[tb, k, :, :rank]


def attach_lora(model: AdaptedModel, rank: int, alpha: float, scaling: str = "standard", dropout: float = 0.0) -> None:
    """Wrap every target linear of ``model`` in a :class:`LoRALinear` (factors zero until loaded)."""
    model.attach(lambda name, lin: LoRALinear(lin, rank, alpha, scaling, dropout))


def lora_modules(model: AdaptedModel) -> dict[str, LoRALinear]:
    mods = model.adapters()
    bad = [n for n, m in mods.items() if not isinstance(m, LoRALinear)]
    if bad or not mods:
        raise TypeError("the model has no LoRA adapters attached" if not mods else f"not LoRA adapters: {bad}")
    return mods  # type: ignore[return-value]
