"""The model every method works on: a backbone with named target linears and an explicit head.

Weight layout is ``[out, in]`` everywhere (``nn.Linear``); a target ``nn.Conv2d`` (``groups = 1``) is seen as the
matrix ``[out, in·kh·kw]`` of its kernel (:func:`weight_matrix`), its input map being the convolution with that
kernel and its output map a 1×1 convolution, so a factored path ``B (A x)`` is the usual LoRA-for-convolutions.
An adapter replaces a target by a wrapper that keeps the frozen pretrained weight ``W0``, an explicit **base
delta** (changes methods make to the frozen weight: FedEx-LoRA residuals, FLoRA merges, ILoRA's QR offset, SSF backfill...) and its own
trainable parameters. The effective weight is ``W0 + base_delta + adapter_delta``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..models.quantize import is_quantized, quantized_output

TARGET_TYPES = (nn.Linear, nn.Conv2d)


def matrix_shape(layer: nn.Module) -> tuple[int, int]:
    """``(out, in)`` of a target's weight seen as a matrix: ``nn.Linear`` ``[out, in]``, ``nn.Conv2d``
    ``[out, in·kh·kw]``."""
    w = layer.weight
    return int(w.shape[0]), math.prod(w.shape[1:])


def weight_matrix(layer: nn.Module) -> torch.Tensor:
    """The target's weight as ``[out, in]`` (a view; a convolution kernel ``[out, in, kh, kw]`` flattened)."""
    return layer.weight.reshape(layer.weight.shape[0], -1)


class AdaptedLinear(nn.Module):
    """A frozen ``nn.Linear`` (or ``nn.Conv2d``, as its ``[out, in·kh·kw]`` matrix) plus an explicit base delta;
    subclasses add a trainable low-rank path written with :meth:`input_map` and :meth:`output_map`.

    Attributes:
        base: the original layer, ``weight: [out, in]`` (a convolution: ``[out, in, kh, kw]``) frozen.
        base_delta: ``[out, in]`` non-persistent buffer (moves with the module) or ``None`` (= zero), part of
            the frozen weight the server owns.
    """

    def __init__(self, base: nn.Linear | nn.Conv2d):
        super().__init__()
        if isinstance(base, nn.Conv2d) and base.groups != 1:
            raise ValueError(f"an adapter needs a convolution with groups = 1, got groups = {base.groups}")
        self.base = base
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        self.register_buffer("base_delta", None, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The frozen pretrained weight (for models that read ``layer.weight.dtype``, as ViT's patch embedding does)."""
        return self.base.weight

    @property
    def out_features(self) -> int:
        return matrix_shape(self.base)[0]

    @property
    def in_features(self) -> int:
        return matrix_shape(self.base)[1]

    def frozen_weight(self) -> torch.Tensor:
        """``W0 + base_delta``: ``[out, in]``."""
        w = weight_matrix(self.base)
        return w if self.base_delta is None else w + self.base_delta

    def input_map(self, x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """``A [r, in]`` applied to the layer input: ``x Aᵀ``, or the convolution with kernel ``A`` reshaped to
        ``[r, in, kh, kw]`` (the layer's stride, padding, dilation); in the input's dtype (an fp32 factor over a
        bf16 backbone computes in bf16, its gradient flows back to fp32)."""
        A = A.to(x.dtype)
        if isinstance(self.base, nn.Conv2d):
            b = self.base
            return F.conv2d(x, A.reshape(A.shape[0], *b.weight.shape[1:]), None, b.stride, b.padding, b.dilation)
        return F.linear(x, A)

    def output_map(self, h: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """``B [out, r]`` applied to :meth:`input_map`'s output: ``h Bᵀ``, or a 1×1 convolution (in ``h``'s
        dtype)."""
        B = B.to(h.dtype)
        if isinstance(self.base, nn.Conv2d):
            return F.conv2d(h, B[:, :, None, None])
        return F.linear(h, B)

    def store_frozen(self, dtype: torch.dtype) -> None:
        """Keep this adapter's frozen buffers (base delta, a Gram adapter's bases, a subspace projector...) in
        ``dtype``, the backbone's (its trainable parameters keep theirs); in place, so that cohort members'
        views (:meth:`AdaptedModel.shared_copy`) keep sharing them."""
        for buf in self._buffers.values():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                buf.data = buf.data.to(dtype)

    def set_base_delta(self, delta: torch.Tensor | None) -> None:
        if delta is not None and tuple(delta.shape) != matrix_shape(self.base):
            raise ValueError(f"base_delta shape {tuple(delta.shape)} != weight shape {matrix_shape(self.base)}")
        w = self.base.weight
        self.base_delta = None if delta is None else delta.detach().to(device=w.device, dtype=w.dtype)

    def set_frozen_weight(self, weight: torch.Tensor) -> None:
        """Make the frozen weight ``weight`` ``[out, in]`` (on any device): ``base_delta = weight − W0``."""
        w = weight_matrix(self.base)
        self.set_base_delta(weight.to(w.device) - w.detach())

    def adapter_delta(self) -> torch.Tensor:
        """Dense ``[out, in]`` update of the trainable path (for export and tests; not used in forward)."""
        return torch.zeros_like(weight_matrix(self.base))

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The trainable path's contribution to the output, computed in factored form; ``None`` for none."""
        return None

    @classmethod
    def joint_adapter_output(cls, members: list["AdaptedLinear"], x: torch.Tensor) -> torch.Tensor | None:
        """:meth:`adapter_output` of every one of ``members`` (of this class) on its equal share of ``x``
        (``[K·n, ..., in]``, member k's rows ``k·n ... (k+1)·n − 1``) in a few batched products, or ``None`` when
        this class cannot batch them (then each member runs on its own rows). A subclass that overrides
        :meth:`adapter_output` overrides this too."""
        return None

    def frozen_output(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen layer's output, with ``W0 + base_delta`` and the base's bias (a quantised ``W0``:
        :func:`fedlowrank.models.quantize.quantized_output`, which keeps no dense weight for the backward)."""
        if is_quantized(self.base):
            return quantized_output(self.base, x, self.base_delta)
        if isinstance(self.base, nn.Conv2d):
            b = self.base
            return F.conv2d(x, self.frozen_weight().reshape(b.weight.shape), b.bias, b.stride, b.padding, b.dilation)
        return F.linear(x, self.frozen_weight(), self.base.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.frozen_output(x)
        extra = self.adapter_output(x)
        return y if extra is None else y + extra


class Routing:
    """Which member of a cohort each part of a joined batch belongs to: member k's rows ``rows[k]``, or, for packed
    rows that hold several members' sequences, each token: ``tokens: [B, T]`` (the member's index, -1 for padding;
    on the host), with ``width`` the tokens per member of :meth:`gather` (0: the most any member has; a fixed
    width, at least that, keeps a compiled step's shapes static). A joined batch has its batch on dimension 0
    (rows) or its first two (tokens). What the joint step reads of it is computed on the host and moved once per
    device, by :meth:`prepare` ahead of the step."""

    def __init__(self, rows: list[slice] | None = None, tokens: torch.Tensor | None = None, size: int = 0,
                 width: int = 0):
        if (rows is None) == (tokens is None):
            raise ValueError("a routing is by rows or by tokens")
        self.rows, self.tokens, self.width = rows, tokens, width
        self.size = len(rows) if rows is not None else size  # members
        self._on: dict[tuple[str, torch.device], tuple[torch.Tensor, ...]] = {}
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gathered(): input, its gather

    def _cached(self, name: str, device: torch.device, make: Callable[[], tuple[torch.Tensor, ...]],
                move: Callable[[torch.Tensor, torch.device], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if (name, device) not in self._on:
            self._on[name, device] = tuple(move(t, device) for t in make())
        return self._on[name, device]

    def prepare(self, device: torch.device, move: Callable[[torch.Tensor, torch.device], torch.Tensor]) -> None:
        """Compute what a joint step reads (:meth:`member_of_rows`, or :meth:`member_of_tokens` and :meth:`gather`)
        and put it on ``device`` with ``move`` (e.g. a non-blocking copy), before the step."""
        if self.rows is not None:
            self.member_of_rows(device, move)
        else:
            self.member_of_tokens(device, move)
            self.gather(device, move)

    def member_of_rows(self, device: torch.device, move=torch.Tensor.to) -> torch.Tensor:
        """``[B]`` each row's member (row routing)."""
        return self._cached("rows", device, lambda: (torch.tensor(
            [k for k, s in enumerate(self.rows) for _ in range(s.start, s.stop)]),), move)[0]

    def member_of_tokens(self, device: torch.device, move=torch.Tensor.to) -> torch.Tensor:
        """``[B·T]`` each token's member (token routing; padding: member 0, whose outputs there must be 0)."""
        return self._cached("tokens", device, lambda: (self.tokens.flatten().clamp_min(0),), move)[0]

    def gather(self, device: torch.device, move=torch.Tensor.to) -> tuple[torch.Tensor, torch.Tensor]:
        """Token routing: ``(index [K, n], valid [K, n])``: member k's flat token indices (into the ``B·T``
        tokens), padded to n = ``width``, or the most any member has (index 0, ``valid`` false), on ``device``."""
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            member = self.tokens.flatten()
            order = torch.argsort(member, stable=True)
            order = order[member[order] >= 0]                                    # padding tokens: no member
            counts = torch.bincount(member[order], minlength=self.size)
            if self.width and int(counts.max()) > self.width:
                raise ValueError(f"a packed member has {int(counts.max())} tokens, more than the routing's "
                                 f"width {self.width}")
            starts = torch.cumsum(counts, 0) - counts
            slot = torch.arange(len(order)) - starts.repeat_interleave(counts)    # each token's place in its member
            index = torch.zeros(self.size, self.width or max(int(counts.max()), 1), dtype=torch.long)
            valid = torch.zeros(index.shape, dtype=torch.bool)
            index[member[order], slot] = order
            valid[member[order], slot] = True
            return index, valid
        index, valid = self._cached("gather", device, make, move)
        return index, valid

    def gathered(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token routing: ``(index [K·n], xs [K·n, in])``, member k's tokens of ``x: [B, T, in]`` gathered in
        :meth:`gather`'s order, padding slots zero rows (so that an adapter's product is 0 there and may be added
        at index 0). The last input's gather is kept: the targets that read one tensor (q, k and v of an attention
        layer) share it."""
        if self._last is not None and self._last[0] is x:
            return self._last[1], self._last[2]
        index, valid = self.gather(x.device)
        index = index.flatten()
        xs = x.reshape(-1, x.shape[-1]).index_select(0, index) * valid.reshape(-1, 1).to(x.dtype)
        self._last = (x, index, xs)
        return index, xs


class RowRouter(nn.Module):
    """Stands in for one module of a cohort's joint forward: rows ``rows[k]`` of the input go through
    ``members[k]`` (the same module in member k's model), outputs concatenated in order. ``[N, ...] → [N, ...]``,
    ``N = rows[-1].stop``; the batch must be dimension 0 (a head: routing by rows only). Made once per cohort's
    fit; each step's :class:`Routing` is set by :meth:`route`."""

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        self.members = members  # a plain list: not submodules of the joint network
        self.routing: Routing | None = None
        self.rows: list[slice] | None = None

    def route(self, routing: Routing) -> None:
        """Route the next forward (and its backward) by ``routing``."""
        if routing.rows is None and type(self) is RowRouter:
            raise ValueError("a head cannot be routed per member in packed rows that hold several clients' "
                             "sequences (task.options.pack); set pack = 0")
        self.routing, self.rows = routing, routing.rows

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.rows[-1].stop:
            raise ValueError(f"a joint batch of {self.rows[-1].stop} rows reached a routed module as input "
                             f"{tuple(x.shape)}: routing per client needs the batch on dimension 0")

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check(x)
        return torch.cat([m(x[s], *args, **kwargs) for m, s in zip(self.members, self.rows)])


StackedFactors = Callable[[], "tuple[torch.Tensor, torch.Tensor]"]


class AdapterRouter(RowRouter):
    """A :class:`RowRouter` for an adapted target. When no member holds a base delta, the frozen ``W0`` (shared by
    every member) multiplies all rows at once and only the adapters' paths run per member:

    * with ``stacked`` (the members' LoRA factors of this target as stacked tensors for this step,
      ``A: [K, R, in]`` and ``B: [K, out, R]`` with each member's scale in it,
      :meth:`~fedlowrank.adapters.lora.LoRAStacks.factors`) as two batched products: ``x: [K·n, ..., in]`` seen as
      ``[K, n·…, in]`` when the members have as many rows each, or, routed by tokens (packed rows), each member's
      tokens gathered into ``[K·n, in]`` (:meth:`Routing.gathered`, shared by the targets that read the same input;
      padding slots are zero rows) and each result added back at its token;
    * else batched by the adapter's class when it can (:meth:`AdaptedLinear.joint_adapter_output`), else each
      member on its own rows (or tokens).

    When a member holds a base delta, each member's rows go through its own ``W0 + base_delta``. ``batched``: whether
    the last forward used ``stacked`` (else a member's own factors, its own parameters, got their gradient)."""

    def __init__(self, members: list[nn.Module], stacked: StackedFactors | None = None):
        super().__init__(members)
        self.stacked = stacked
        self.batched = False

    @property
    def weight(self) -> torch.Tensor:
        return self.members[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batched = False
        if self.rows is None:
            return self._by_tokens(x)
        self._check(x)
        if any(m.base_delta is not None for m in self.members):
            return super().forward(x)
        y = self.members[0].frozen_output(x)
        kind = type(self.members[0])
        if len({s.stop - s.start for s in self.rows}) == 1 and all(type(m) is kind for m in self.members):
            if self.stacked is not None:
                A, B = self.stacked()
                self.batched = True
                xs = x.reshape(len(self.members), -1, x.shape[-1])                 # [K, n·…, in]: a view
                return y + torch.bmm(torch.bmm(xs, A.mT), B.mT).reshape(*y.shape)
            extra = kind.joint_adapter_output(self.members, x)
            if extra is not None:
                return y + extra
        outs = []
        for m, s in zip(self.members, self.rows):
            extra = m.adapter_output(x[s])
            outs.append(y[s] if extra is None else y[s] + extra)
        return torch.cat(outs)

    def _by_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, in] → [B, T, out]`` routed by tokens (linear targets)."""
        flat = x.reshape(-1, x.shape[-1])
        index, xs = self.routing.gathered(x)                             # [K·n], [K·n, in]: member k's tokens
        k, n = self.routing.size, len(index) // self.routing.size
        shared = not any(m.base_delta is not None for m in self.members)
        if shared and self.stacked is not None:
            A, B = self.stacked()
            self.batched = True
            extra = torch.bmm(torch.bmm(xs.view(k, n, -1), A.mT), B.mT).view(k * n, -1)
            return self.members[0].frozen_output(flat).index_add_(0, index, extra).reshape(*x.shape[:-1], -1)
        kind = type(self.members[0])
        extra = kind.joint_adapter_output(self.members, xs) if shared and all(
            type(m) is kind for m in self.members) else None
        if extra is None:  # each member on its own tokens: its adapter (and its own W0 + base delta)
            outs = [m(xs[i * n:(i + 1) * n]) if not shared else m.adapter_output(xs[i * n:(i + 1) * n])
                    for i, m in enumerate(self.members)]
            extra = torch.cat([o if o is not None else xs.new_zeros(n, self.members[0].out_features) for o in outs])
        valid = self.routing.gather(flat.device)[1].reshape(-1, 1)
        extra = extra * valid.to(extra.dtype)
        out = extra.new_zeros(flat.shape[0], extra.shape[-1]).index_add(0, index, extra)
        if shared:
            out = out + self.members[0].frozen_output(flat)
        return out.reshape(*x.shape[:-1], -1)


def _get_parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parts = name.split(".")
    parent = root
    for p in parts[:-1]:
        parent = getattr(parent, p)
    return parent, parts[-1]


class AdaptedModel(nn.Module):
    """Backbone ``net`` with resolved target linears and head parameters.

    Args:
        net: the full model (e.g. ``BertForSequenceClassification``); its forward is the task's business.
        target_names: full module names of the target ``nn.Linear`` (or ``nn.Conv2d``) layers, e.g.
            ``bert.encoder.layer.0.attention.self.query``.
        head_names: full parameter names of the head (trained and shared unless a method says otherwise).
        frozen_head_names: full parameter names of a new head held at its initialisation (trained by no client,
            sent in no message; FedBABU), which the base does not hold and an export therefore carries.

    Attributes:
        stored_dtype: the dtype (``train.dtype``'s name) its frozen backbone is stored in, ``"fp32"`` as loaded
            (:func:`fedlowrank.device.store_frozen` sets it).
    """

    def __init__(self, net: nn.Module, target_names: list[str], head_names: list[str],
                 frozen_head_names: list[str] = ()):
        super().__init__()
        self.net = net
        self.target_names = list(target_names)
        self.head_names = list(head_names)
        self.frozen_head_names = list(frozen_head_names)
        self.stored_dtype = "fp32"
        for name in self.target_names:
            mod = net.get_submodule(name)
            if not isinstance(mod, (*TARGET_TYPES, AdaptedLinear)):
                raise ValueError(f"target module {name!r} is a {type(mod).__name__}, not nn.Linear or nn.Conv2d")
        params = dict(net.named_parameters())
        missing = [n for n in (*self.head_names, *self.frozen_head_names) if n not in params]
        if missing:
            raise ValueError(f"head parameters not found in the model: {missing}")
        for p in net.parameters():
            p.requires_grad_(False)

    # -- targets ---------------------------------------------------------------------------------------
    def target(self, name: str) -> nn.Module:
        """The module at a target name: an ``nn.Linear`` or, once attached, its :class:`AdaptedLinear`."""
        return self.net.get_submodule(name)

    def targets(self) -> Iterator[tuple[str, nn.Module]]:
        for name in self.target_names:
            yield name, self.target(name)

    def base_linear(self, name: str) -> nn.Linear:
        mod = self.target(name)
        return mod.base if isinstance(mod, AdaptedLinear) else mod

    def base_matrix(self, name: str) -> torch.Tensor:
        """The target's pretrained weight as ``[out, in]`` (a convolution's kernel flattened; a view)."""
        return weight_matrix(self.base_linear(name))

    def attach(self, make: Callable[[str, nn.Linear], AdaptedLinear]) -> None:
        """Replace every target linear by ``make(name, linear)`` (idempotent per kind: re-wraps the base)."""
        for name in self.target_names:
            parent, attr = _get_parent(self.net, name)
            setattr(parent, attr, make(name, self.base_linear(name)))

    def adapters(self) -> dict[str, AdaptedLinear]:
        return {n: m for n, m in self.targets() if isinstance(m, AdaptedLinear)}

    # -- head ------------------------------------------------------------------------------------------
    def head_parameters(self) -> dict[str, nn.Parameter]:
        """The head's parameters by name, each looked up by its path (not a walk of the whole network)."""
        return {n: self.net.get_parameter(n) for n in self.head_names}

    def exported_head(self) -> dict[str, nn.Parameter]:
        """What an export carries besides the adapters: the trained head's parameters and a frozen new head's."""
        return {n: self.net.get_parameter(n) for n in sorted({*self.head_names, *self.frozen_head_names})}

    def head_modules(self) -> list[str]:
        """Names of the outermost modules holding the head's parameters (e.g. ``classifier``)."""
        owners = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in self.head_names})
        if "" in owners:
            raise ValueError("a head parameter that belongs to the network itself cannot be routed per client")
        return [o for o in owners if not any(o.startswith(p + ".") for p in owners)]

    def frozen_parameters(self) -> list[nn.Parameter]:
        """The parameters no method trains: all but :meth:`own_parameters` and the weights of targets left without
        an adapter (which full fine-tuning trains); each tied parameter once."""
        keep = {id(p) for p in self.own_parameters()}
        keep |= {id(p) for _, m in self.targets() if not isinstance(m, AdaptedLinear) for p in m.parameters()}
        unique = {id(p): p for p in self.net.parameters()}
        return [p for i, p in unique.items() if i not in keep]

    def trained_modules(self) -> list[nn.Module]:
        """Modules whose parameters a method may train inside a frozen backbone: the head's outermost modules and
        the targets left without an adapter."""
        return ([self.net.get_submodule(n) for n in self.head_modules()]
                + [m for _, m in self.targets() if not isinstance(m, AdaptedLinear)])

    def own_parameters(self) -> list[nn.Parameter]:
        """What a client may train: the adapters' own parameters (not their frozen base) and the head's."""
        own = [p for m in self.adapters().values() for n, p in m.named_parameters() if not n.startswith("base.")]
        return own + list(self.head_parameters().values())

    def shared_copy(self) -> "AdaptedModel":
        """A copy that owns its :meth:`own_parameters` and shares every other tensor (the frozen backbone,
        buffers) with this model: a cohort member's model (:mod:`fedlowrank.runtime.cohort`). Buffers can be
        shared because methods replace them (``set_base_delta``) and never write into them."""
        own = {id(p) for p in self.own_parameters()}
        memo = {id(t): t for t in (*self.parameters(), *self.buffers()) if id(t) not in own}
        return copy.deepcopy(self, memo)

    def routers(self, members: list["AdaptedModel"],
                stacked: dict[str, StackedFactors] | None = None) -> dict[str, RowRouter]:
        """For every adapted target and head module of this model, the router (:class:`AdapterRouter`,
        :class:`RowRouter`) through member ``k``'s own module (its factors, base delta, scale, head) for member
        ``k``'s rows or tokens; ``stacked``: the stacked factors of the targets that have them. Made once per
        cohort's fit, used by :meth:`routed` at every step."""
        routers: dict[str, RowRouter] = {}
        for name in self.target_names:
            routers[name] = AdapterRouter([m.net.get_submodule(name) for m in members], (stacked or {}).get(name))
        for name in self.head_modules():
            routers[name] = RowRouter([m.net.get_submodule(name) for m in members])
        return routers

    @contextlib.contextmanager
    def routed(self, routers: dict[str, RowRouter], routing: Routing):
        """Within the block, this model's forward (and a backward that recomputes checkpointed layers) sends
        member ``k``'s rows (or tokens, :class:`Routing`) of every adapted target and head module through member
        ``k``'s own module (``routers``, :meth:`routers`); the rest of the network, shared by every member
        (:meth:`shared_copy`), sees all of the batch at once."""
        originals = []
        try:
            for name, router in routers.items():
                router.route(routing)
                parent, attr = _get_parent(self.net, name)
                originals.append((parent, attr, getattr(parent, attr)))
                setattr(parent, attr, router)
            yield
        finally:
            for parent, attr, module in reversed(originals):
                setattr(parent, attr, module)

    def set_trainable(self, params: dict[str, nn.Parameter]) -> None:
        """Freeze everything, then unfreeze exactly ``params``, which must be parameters of the network (a
        quantised backbone's weight is not one: ``task.quantize`` keeps the backbone frozen)."""
        own = {id(p) for p in self.net.parameters()}
        foreign = [n for n, p in params.items() if id(p) not in own]
        if foreign:
            raise ValueError(f"{foreign[0]!r} is not a trainable parameter of the model: with task.quantize the "
                             f"backbone's weights are frozen in 4/8 bits; use a LoRA-family method")
        for p in self.net.parameters():
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)
