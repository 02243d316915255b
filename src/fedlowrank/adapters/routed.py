"""A routed mixture of LoRA experts on one target linear, with a per-token softmax router (FedALT's
individual + Rest-of-World pair, arXiv:2503.11880; FedLEASE's clustered experts, arXiv:2509.15087).

Per target linear ``W0: [out, in]``, E experts of rank r and S router slots:

* expert 0 is the client's own, trainable: ``lora_A: [r, in]``, ``lora_B: [out, r]``;
* experts 1..E−1 are frozen (non-persistent buffers, loaded from the message): ``others_A: [E−1, r, in]``,
  ``others_B: [E−1, out, r]``;
* the router ``router: [S, in]`` (and ``router_bias: [S]`` when it has one), trainable; ``slot_expert: [S]`` maps each
  slot to an expert; ``top_k`` slots are kept per token.

For a token ``x``: ``p = softmax(router x + b)`` over the S slots, ``p`` is zeroed outside its ``top_k`` largest
entries (no renormalisation), ``gₑ = Σ_{slots j of expert e} pⱼ``, and
``y = x (W0 + base_delta)ᵀ + s · Σₑ gₑ(x) Bₑ Aₑ dropout(x)`` with the LoRA scale ``s``; the experts run as one LoRA of
rank E·r whose r-blocks are weighted by ``g`` per token (no loop over experts). The router reads ``x`` itself (no
dropout). Linear targets only: a per-token router has no meaning on a convolution's flattened kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from .lora import lora_scale
from .model import AdaptedLinear, AdaptedModel


class RoutedLoRALinear(AdaptedLinear):
    """``y = x (W0 + base_delta)ᵀ + s · Σₑ gₑ(x) Bₑ Aₑ dropout(x) + bias`` (see the module docstring).

    Args:
        base: the frozen ``nn.Linear`` ``[out, in]``.
        rank, alpha, scaling, dropout: as :class:`~fedlowrank.adapters.lora.LoRALinear`.
        slot_expert: ``[S]`` the expert of each router slot (values in ``0 .. E−1``, E = max + 1).
        top_k: slots kept per token (``1 .. S``).
        bias: whether the router has a bias.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, scaling: str, dropout: float,
                 slot_expert: list[int], top_k: int, bias: bool = False):
        if not isinstance(base, nn.Linear):
            raise ValueError(f"a routed LoRA mixture adapts linear layers only (its router acts per token), got a "
                             f"{type(base).__name__}; choose linear targets (lora.targets)")
        super().__init__(base)
        if rank < 1 or rank > min(self.in_features, self.out_features):
            raise ValueError(f"lora.rank must be in [1, {min(self.in_features, self.out_features)}], got {rank}")
        experts = max(slot_expert) + 1
        self.scale = lora_scale(alpha, rank, scaling)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))
        self.register_buffer("others_A", torch.zeros(experts - 1, rank, self.in_features, **like), persistent=False)
        self.register_buffer("others_B", torch.zeros(experts - 1, self.out_features, rank, **like), persistent=False)
        self.router = nn.Parameter(torch.zeros(len(slot_expert), self.in_features, **like))
        self.router_bias = nn.Parameter(torch.zeros(len(slot_expert), **like)) if bias else None
        self.register_buffer("slot_expert", torch.tensor([0]), persistent=False)
        self.set_routing(slot_expert, top_k)

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    @property
    def experts(self) -> int:
        return self.others_A.shape[0] + 1

    def set_routing(self, slot_expert: list[int], top_k: int) -> None:
        """Change the slots' experts and ``top_k``; when the number of experts or slots changes, the frozen experts
        become zeros and the router (and bias) new zero parameters of the new sizes, to be loaded by
        :meth:`set_experts`."""
        experts = max(slot_expert) + 1
        if sorted(set(slot_expert)) != list(range(experts)) or not 1 <= top_k <= len(slot_expert):
            raise ValueError(f"router slots {slot_expert} must cover experts 0..E-1 and top_k {top_k} be in "
                             f"[1, {len(slot_expert)}]")
        self.top_k = top_k
        if experts != self.experts:
            self.others_A = self.others_A.new_zeros(experts - 1, *self.others_A.shape[1:])
            self.others_B = self.others_B.new_zeros(experts - 1, *self.others_B.shape[1:])
        if len(slot_expert) != self.router.shape[0]:
            self.router = nn.Parameter(self.router.new_zeros(len(slot_expert), self.in_features))
            if self.router_bias is not None:
                self.router_bias = nn.Parameter(self.router_bias.new_zeros(len(slot_expert)))
        self.slot_expert = torch.tensor(slot_expert, device=self.slot_expert.device)

    def set_experts(self, A: torch.Tensor, B: torch.Tensor, others_A: torch.Tensor, others_B: torch.Tensor,
                    router: torch.Tensor, router_bias: torch.Tensor | None = None) -> None:
        """Load the own expert ``A: [r, in]``, ``B: [out, r]``, the frozen ones ``[E−1, r, in]``, ``[E−1, out, r]``
        and the router ``[S, in]`` (and its bias ``[S]``)."""
        shapes = {"A": (A, self.lora_A), "B": (B, self.lora_B), "others_A": (others_A, self.others_A),
                  "others_B": (others_B, self.others_B), "router": (router, self.router)}
        if self.router_bias is not None:
            shapes["router_bias"] = (router_bias, self.router_bias)
        for what, (new, old) in shapes.items():
            if new is None or tuple(new.shape) != tuple(old.shape):
                raise ValueError(f"routed LoRA {what}: expected shape {tuple(old.shape)}, got "
                                 f"{None if new is None else tuple(new.shape)}")
        with torch.no_grad():
            for what, (new, old) in shapes.items():
                if isinstance(old, nn.Parameter):
                    old.copy_(new)
                else:  # frozen buffers are replaced, never written into: cohort members share them
                    setattr(self, what, new.detach().to(old.device, old.dtype, copy=True))

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """``g: [..., E]``, each expert's weight per token of ``x: [..., in]`` (top-k slots of the softmax, summed
        per expert)."""
        logits = nn.functional.linear(x, self.router.to(x.dtype),
                                      None if self.router_bias is None else self.router_bias.to(x.dtype))
        p = torch.softmax(logits.float(), dim=-1)
        if self.top_k < p.shape[-1]:
            kept = torch.zeros_like(p).scatter_(-1, p.topk(self.top_k, dim=-1).indices, 1.0)
            p = p * kept
        onehot = nn.functional.one_hot(self.slot_expert, self.experts).to(p.dtype)       # [S, E]
        return (p @ onehot).to(x.dtype)

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A: [E, r, in], B: [E, out, r])``, the own expert first."""
        return (torch.cat([self.lora_A[None], self.others_A.to(self.lora_A.dtype)]),
                torch.cat([self.lora_B[None], self.others_B.to(self.lora_B.dtype)]))

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        A, B = self._stacked()
        E, r = A.shape[0], A.shape[1]
        h = self.input_map(self.dropout(x), A.reshape(E * r, -1))                            # [..., E·r]
        h = (h.unflatten(-1, (E, r)) * self.gates(x)[..., None]).flatten(-2)
        return self.scale * self.output_map(h, B.permute(1, 0, 2).reshape(self.out_features, E * r))

    def adapter_delta(self) -> torch.Tensor:
        """``s · Σₑ gₑ(0) Bₑ Aₑ``: ``[out, in]``, the update at a token the router gives no signal (``x = 0``, gates
        from the bias alone). The real update depends on each token, so this is for inspection only: export refuses
        routed mixtures."""
        A, B = self._stacked()
        g = self.gates(A.new_zeros(self.in_features))                                     # [E]
        return self.scale * torch.einsum("e,eor,eri->oi", g.to(A.dtype), B, A)


def routed_modules(model: AdaptedModel) -> dict[str, RoutedLoRALinear]:
    mods = model.adapters()
    bad = [n for n, m in mods.items() if not isinstance(m, RoutedLoRALinear)]
    if bad or not mods:
        raise TypeError("the model has no routed LoRA adapters attached" if not mods else f"not routed: {bad}")
    return mods  # type: ignore[return-value]


__all__ = ["RoutedLoRALinear", "routed_modules"]
