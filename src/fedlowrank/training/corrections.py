"""Client-side drift corrections that compose with any method training named parameters.

A correction sees the trainable parameters as ``{key: Parameter}`` where the keys are the message keys
(e.g. ``"<module>.lora_A"``, ``"head/<param>"``). Hooks, in round order:

* server: ``init_server`` (add its server state), ``broadcast`` (extra download entries),
  ``aggregate`` (update its server state from the replies);
* client: ``start`` (round start), ``loss`` (extra loss term), ``grad`` (edit gradients before the optimizer
  step), ``finish`` (extra upload entries; updates the client state in place).

``start`` sets every per-client attribute anew: each fit trains with shallow copies of the method's corrections
(:func:`corrected_fit`), so that a cohort's members (:mod:`fedlowrank.runtime.cohort`) never share one.

:class:`FedProx` is Li et al. 2020 (μ/2·‖w − w_global‖²). :class:`Scaffold` is Karimireddy et al. 2020, with
the global variate updated by ``c ← c + (|S|/N)·mean(Δcᵢ)`` so that ``c`` stays the mean of all clients'
``cᵢ`` under partial participation (all start at zero).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..message import Message, Reply, State
from ..schema import check_choice
from .local import Fit

CORRECTIONS = ("none", "fedprox", "scaffold", "fedprox+scaffold")
CV_REFRESH = ("mean", "last", "option2")


class ClientCorrection:
    """One correction's hooks (module docstring). ``client_state``: what it keeps in the client's state across
    rounds, in words with shapes (``""``: nothing); the method's ``keeps_client_state`` reads it.
    ``server_entries``, ``client_entries``: the templates of the entries it adds to the server's and a client's state
    after they were made (``Method.state_entries``); ``upload_entries``: those of the tensors it adds to a reply
    (``Method.upload_templates``). ``reads_batch``: whether its ``loss`` reads the step's batch (MOON's features; a
    cohort then stages each member's own batch)."""

    name = ""
    client_state = ""
    server_entries: tuple[str, ...] = ()
    client_entries: tuple[str, ...] = ()
    upload_entries: tuple[str, ...] = ()
    reads_batch = False

    def init_server(self, server: State, shapes: dict[str, tuple[int, ...]]) -> None:
        pass

    def broadcast(self, server: State) -> dict[str, torch.Tensor]:
        return {}

    def start(self, msg: Message, state: State, params: dict[str, nn.Parameter]) -> None:
        pass

    def loss(self, params: dict[str, nn.Parameter], net: nn.Module, batch, task) -> torch.Tensor | None:
        """Extra loss term for this step (``net`` is in train mode, ``batch`` the current batch)."""
        return None

    def grad(self, params: dict[str, nn.Parameter]) -> None:
        pass

    def finish(self, params: dict[str, nn.Parameter], state: State, result) -> dict[str, torch.Tensor]:
        return {}

    def aggregate(self, server: State, replies: list[Reply], num_clients: int) -> None:
        pass

    def upload_spec(self, down: Message, trained: dict) -> dict:
        """What this correction adds to a reply to ``down``, given the trained tensors' specs
        (``{key: TensorSpec}``, :class:`fedlowrank.methods.base.TensorSpec`)."""
        return {}


class FedProx(ClientCorrection):
    """Adds ``μ/2 · Σ ‖w − w_start‖²`` over the trainable parameters (w_start = what was broadcast)."""

    name = "fedprox"

    def __init__(self, mu: float):
        if mu < 0:
            raise ValueError(f"method.mu must be >= 0, got {mu}")
        self.mu = mu
        self._anchor: dict[str, torch.Tensor] = {}

    def start(self, msg: Message, state: State, params: dict[str, nn.Parameter]) -> None:
        self._anchor = {k: p.detach().clone() for k, p in params.items()}

    def loss(self, params: dict[str, nn.Parameter], net: nn.Module, batch, task) -> torch.Tensor:
        total = sum(((p - self._anchor[k]) ** 2).sum() for k, p in params.items())
        return 0.5 * self.mu * total  # type: ignore[return-value]


class Scaffold(ClientCorrection):
    """SCAFFOLD control variates on the trainable parameters.

    Download ``scaffold.c/<key>``; client state ``scaffold.ci/<key>``; upload ``scaffold.dc/<key>`` = Δcᵢ.
    Local gradient: ``g + c − cᵢ`` (what the optimizer sees). After K local steps, ``cᵢ⁺`` by ``refresh``:

    * ``"mean"`` (default): the mean of the K raw gradients ``g`` of the round (after ``train.max_grad_norm``
      clipping, which the trainer applies before this hook). Under plain SGD with step η, clipped or not, this
      *is* option II, since ``x − yᵢ = η Σ (g + c − cᵢ)`` gives ``(x − yᵢ)/(Kη) − c + cᵢ = mean g``; under
      momentum, Adam or AdamW it stays on the scale of a gradient, where option II's ``(x − yᵢ)/(Kη)`` measures
      normalised steps (≈ 1 per coordinate for Adam) and the correction ``c − cᵢ`` swamps the gradients.
    * ``"last"``: the last raw gradient.
    * ``"option2"``: the paper's literal ``cᵢ⁺ = cᵢ − c + (x − yᵢ)/(K η)`` (use with ``optimizer = "sgd"``).
    """

    name = "scaffold"
    client_state = "the client's control variate scaffold.ci/<key>, shaped as each trained tensor"
    prefix_c, prefix_ci, prefix_dc = "scaffold.c/", "scaffold.ci/", "scaffold.dc/"

    @property
    def client_entries(self) -> tuple[str, ...]:
        return (self.prefix_ci + "{key}",)

    @property
    def upload_entries(self) -> tuple[str, ...]:
        return (self.prefix_dc + "{key}",)

    def __init__(self, refresh: str = "mean"):
        check_choice("method.cv_grad", refresh, CV_REFRESH)
        self.refresh = refresh
        self._c: dict[str, torch.Tensor] = {}
        self._ci: dict[str, torch.Tensor] = {}
        self._x: dict[str, torch.Tensor] = {}
        self._raw: dict[str, torch.Tensor] = {}
        self._steps = 0

    def init_server(self, server: State, shapes: dict[str, tuple[int, ...]]) -> None:
        for k, shape in shapes.items():
            like = server.get(k)  # controls in the trained tensor's dtype (float64 for the matrix regression)
            server[self.prefix_c + k] = torch.zeros(shape, dtype=like.dtype if isinstance(like, torch.Tensor) else None)

    def broadcast(self, server: State) -> dict[str, torch.Tensor]:
        return {k: v for k, v in server.items() if k.startswith(self.prefix_c)}

    def start(self, msg: Message, state: State, params: dict[str, nn.Parameter]) -> None:
        self._c = {k: msg[self.prefix_c + k].to(p.device) for k, p in params.items()}
        self._ci = {k: state.get(self.prefix_ci + k, torch.zeros_like(p)).to(p.device) for k, p in params.items()}
        self._x = {k: p.detach().clone() for k, p in params.items()}
        self._raw = {k: torch.zeros_like(p) for k, p in params.items()}
        self._steps = 0

    def grad(self, params: dict[str, nn.Parameter]) -> None:
        for k in self._c:
            grad = params[k].grad
            if self.refresh == "mean" and grad is not None:       # the raw gradient, before the correction
                self._raw[k].add_(grad)
            elif self.refresh == "last":
                self._raw[k] = torch.zeros_like(self._raw[k]) if grad is None else grad.detach().clone()
            if grad is not None:
                grad.add_(self._c[k] - self._ci[k])
        self._steps += 1

    def refreshed(self, k: str, p: torch.Tensor, result) -> torch.Tensor:
        """The client's new control variate ``cᵢ⁺`` of parameter ``k`` (now at ``p``) by ``refresh``."""
        if self.refresh == "option2":
            lr = result.head_lr if k.startswith("head/") and result.head_lr is not None else result.lr
            return self._ci[k] - self._c[k] + (self._x[k] - p.detach()) / (max(result.steps, 1) * lr)
        return self._raw[k] / max(self._steps, 1) if self.refresh == "mean" else self._raw[k]

    def finish(self, params: dict[str, nn.Parameter], state: State, result) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k in self._c:
            new_ci = self.refreshed(k, params[k], result)
            out[self.prefix_dc + k] = new_ci - self._ci[k]
            state[self.prefix_ci + k] = new_ci
        return out

    def upload_spec(self, down: Message, trained: dict) -> dict:
        """``Δcᵢ`` of each trained tensor that has a control variate in ``down``, of that tensor's spec."""
        return {self.prefix_dc + k: spec for k, spec in trained.items() if self.prefix_c + k in down}

    def aggregate(self, server: State, replies: list[Reply], num_clients: int) -> None:
        frac = len(replies) / num_clients
        for key in [k for k in server if k.startswith(self.prefix_c)]:
            name = key[len(self.prefix_c):]
            dc = [r.message[self.prefix_dc + name].to(torch.float64) for r in replies]
            server[key] = (server[key].to(torch.float64) + frac * torch.stack(dc).mean(0)).to(server[key].dtype)


def make_corrections(spec: str, mu: float = 0.01, cv_grad: str = "mean") -> list[ClientCorrection]:
    """Build the corrections named by ``spec`` (one of :data:`CORRECTIONS`); ``cv_grad`` is SCAFFOLD's refresh."""
    check_choice("method.correction", spec, CORRECTIONS)
    out: list[ClientCorrection] = []
    if "fedprox" in spec:
        out.append(FedProx(mu))
    if "scaffold" in spec:
        out.append(Scaffold(cv_grad))
    return out


def corrected_fit(corrections: list[ClientCorrection], model, msg: Message, state: State,
                  params: dict[str, nn.Parameter], optimizer=None) -> Fit:
    """The :class:`~fedlowrank.training.local.Fit` of ``params`` (already loaded into ``model``, now its only
    trainable parameters) with this fit's own copies of ``corrections``, started (their ``start`` hooks, which set
    every per-client attribute anew: several clients' fits may be prepared before any runs), and a copy of the
    client's ``state`` that their ``finish`` hooks update."""
    model.set_trainable(params)
    state = State(state)
    own = [copy.copy(c) for c in corrections]
    for c in own:
        c.start(msg, state, params)
    return Fit(model, params, own, optimizer, msg, state)


def finish_corrections(fit: Fit, result) -> dict[str, torch.Tensor]:
    """After the fit: the corrections' ``finish`` hooks (their reply entries, returned; the client's new state,
    ``fit.state``, updated)."""
    extra: dict[str, torch.Tensor] = {}
    for c in fit.corrections:
        extra.update(c.finish(fit.params, fit.state, result))
    return extra


def fit_with_corrections(corrections: list[ClientCorrection], model, msg: Message, state: State,
                         params: dict[str, nn.Parameter], trainer, optimizer=None):
    """Train ``params`` (already loaded into ``model``) with the composed corrections: :func:`corrected_fit`,
    ``trainer.fit``, :func:`finish_corrections`. Returns ``(fit result, extra reply entries from the corrections,
    the client's new state)``."""
    fit = corrected_fit(corrections, model, msg, state, params, optimizer)
    result = trainer.fit(fit.model, fit.params, fit.corrections, fit.optimizer)
    return result, finish_corrections(fit, result), fit.state
