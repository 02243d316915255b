"""The method contract (docs/architecture.md, "The method contract") and the pieces LoRA-style methods share.

One round of any method::

    msg_k            = method.broadcast(server, k, rnd)                 # what goes down to client k
    reply_k, state_k = method.train(model, msg_k, state_k, trainer)     # client side (trainer = data + loss + hp)
    server           = method.aggregate(server, [Reply(k, n_k, reply_k)...], rnd)

``train`` is, by default, two phases around the local steps: ``fit = prepare_fit(...)``, the trainer's steps,
``finish_fit(fit, result, trainer)``; a method with the two phases trains in client cohorts
(``supports_cohorts``), whose runtime prepares every member's fit, steps them together and finishes each.

Server and client state are explicit :class:`~fedlowrank.message.State` objects; per-client state lives in a
store the runtime owns, never in the method. The runtime serialises every message and counts its bytes.
A method never imports a runtime, and runtimes never look at a method's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from ..adapters.lora import attach_lora, init_lora_factors, load_factors, lora_modules
from ..adapters.model import AdaptedModel
from ..message import Message, Reply, State
from ..schema import Declared, Schema, declared, setting
from ..seeding import torch_generator
from ..training.corrections import (CORRECTIONS, CV_REFRESH, ClientCorrection, corrected_fit, finish_corrections,
                                    make_corrections)
from ..training.local import Fit, FitResult


@dataclass
class SetupInfo:
    """Everything a method may know about the run when it sets up (identical on server and clients).

    Attributes:
        num_clients: M, the number of clients.
        client_sizes: local data size of each client (length M).
        client_ranks: LoRA rank of each client (length M; all equal unless heterogeneous ranks are used).
        rank: the server/global LoRA rank r (``lora.rank``).
        alpha: ``lora.alpha``; scaling: ``lora.scaling`` (``standard`` α/r or ``rslora`` α/√r); dropout.
        weighting: ``"num_examples"`` (pₖ ∝ nₖ) or ``"uniform"`` (pₖ = 1/K) over the round's replies.
        server_lr: β of the averaging step, ``new = old + β·(avg − old)`` (1 = plain averaging).
        seed: the run's seed (methods derive their streams with :func:`fedlowrank.seeding.derive_seed`).
        rounds: total number of rounds T.
        clients_per_round: K, the clients sampled each round (``run.clients_per_round``).
    """

    num_clients: int
    client_sizes: list[int]
    client_ranks: list[int]
    rank: int = 8
    alpha: float = 16.0
    scaling: str = "standard"
    dropout: float = 0.0
    weighting: str = "num_examples"
    server_lr: float = 1.0
    seed: int = 0
    rounds: int = 10
    clients_per_round: int = 1

    @property
    def heterogeneous_ranks(self) -> bool:
        return len(set(self.client_ranks)) > 1


def composes(choices: Iterable[str], correction: str) -> bool:
    """Whether any of the ``correction`` values ``choices`` (``"fedprox+scaffold"``, ...) includes ``correction``."""
    return any(correction in choice.split("+") for choice in choices)


def correction_option(default: str = "none", choices: tuple[str, ...] = CORRECTIONS, why: str = ""):
    """The ``correction`` option: client-side drift corrections composed on a method (``why``: why a method allows
    only some of them)."""
    named = (("FedProx's proximal term", "fedprox"), ("SCAFFOLD's control variates", "scaffold"))
    parts = [part for part, name in named if composes(choices, name)]
    which = {0: "none", 1: "".join(parts), 2: f"{', '.join(parts)}, or both"}[len(parts)]
    return setting(default, f"client-side drift corrections composed on the method: {which}"
                   + (f" ({why})" if why else ""), choices=choices)


def mu_option():
    """The ``mu`` option: FedProx's μ."""
    return setting(0.01, "FedProx's proximal coefficient μ (when method.correction includes fedprox)", ge=0)


def cv_grad_option():
    """The ``cv_grad`` option: how SCAFFOLD refreshes a client's control variate."""
    return setting("mean", "how SCAFFOLD refreshes a client's control variate: the mean raw (clipped) gradient of "
                   "the round (= option II exactly under plain SGD, with or without clipping), the last raw "
                   "gradient, or the paper's literal option II (option2)", choices=CV_REFRESH)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor an honest client sends: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        """The spec a tensor meets (e.g. a downloaded one that comes back trained)."""
        return cls(tuple(t.shape), t.dtype)


Upload = dict[str, TensorSpec]


def specs_of(msg: Message, keys: Iterable[str]) -> Upload:
    """``{key: TensorSpec.of(msg[key])}``: tensors that come back with the shape and dtype they went down with."""
    return {k: TensorSpec.of(msg[k]) for k in keys}


class Method(Schema):
    """Base class of every federated method. Subclasses are dataclasses whose fields are the method's options,
    each declared with :func:`~fedlowrank.schema.setting` (type, default, bounds or choices, meaning): making a
    method checks them (:class:`~fedlowrank.schema.Schema`), ``fedlowrank methods NAME`` lists them. A subclass
    with its own ``__post_init__`` calls ``super().__post_init__()`` first; what stays in it are the rules between
    options, each naming its fields.

    Class attributes (shown by ``fedlowrank methods``):
        name: registered name (lower case, hyphens).
        description: one line.
        paper: the paper it comes from.
        uplink / downlink: what a client sends / receives each round, in words with shapes.
        needs_individual_replies: True if the server step needs each reply (stacking, RPCA, QR of the
            concatenation); False if weighted sums suffice (secure-aggregation friendly).
        privacy_modes: the client-level DP modes the method supports (``"central"``: noise on the sum of the
            replies, needs a server step that is a fixed-weight sum of them; ``"local"``: noise on each reply,
            works with any server step); ``None`` = derived from ``needs_individual_replies``
            (:meth:`supported_privacy_modes`). A class that narrows it says why in ``privacy_refusal``.
        supports_heterogeneous_ranks: whether clients may have different LoRA ranks; a class without them may
            say why in ``heterogeneous_ranks_refusal`` (the config error quotes it).
        supports_cohorts: derived, never declared: whether several clients train together in a cohort
            (:mod:`fedlowrank.runtime.cohort`), i.e. whether ``train`` is the composition of the two phases
            :meth:`prepare_fit` and :meth:`finish_fit` (the class defines them and keeps the default ``train``).
            The phases train only adapter and head parameters and change nothing of the method; the runtime then
            prepares every member's fit, runs their local steps jointly and finishes each. A method with its own
            ``train`` trains one client at a time.
        reads_features: whether the method's local loss reads each example's representation
            (``task.features``): causal-LM cohorts then leave their examples unpacked (``task.options.pack``).
        personalized: True if each client's model differs from the global one (part of it stays private);
            the runtime then reports the mean over clients of their own models' test metrics.
        preset: the paper's own run settings as ``{"section.key": value}`` config overrides (client weighting,
            local optimizer, ...); ``compare``/``tune`` apply them before the user's overrides, which win.
        lr_grid: the learning rates to tune over (the paper's grid; empty = :data:`DEFAULT_LR_GRID`).
        reference: non-empty for a reference row rather than a federated method: what it is, in words
            (``compare`` marks it as a reference in its tables and plots).
        communicates: False for a method whose clients send and receive nothing (a reference that trains where the
            data is): the runtime's ledger counts zero bytes for it.
        pooled: True for a method that each round trains one model on the pooled data of the round's sampled
            clients, for the sum of their local steps (a centralised reference); the simulator then runs the
            round as one client, the first sampled, holding that data (:func:`~fedlowrank.runtime.engine.pool`).
            Such a method cannot run where each client's data stays on its own node (Flower).
        per_client_downlink: True if :meth:`broadcast` sends client ``k`` a message of its own, computed for
            ``k`` (FedALT's leave-one-out Rest-of-World: the same keys and shapes for every client, other
            values); False if it depends on the client at most through its rank (``info.client_ranks[k]``), so
            equally ranked clients of a round get the same message.
        client_state: what a client keeps across rounds, in words with shapes (:meth:`init_client` makes it,
            :meth:`train` carries it; FedALT's own LoRA ``A¹_k [r,in], B¹_k [out,r]`` and router ``[2,in]``);
            ``""`` when the method itself keeps nothing (composed corrections may: :meth:`keeps_client_state`).
            The runtime stores it (``runtime/store.py`` in the simulator, ``context.state`` on a Flower node),
            checkpoints it, and commits it only when the client's reply was aggregated.
        server_entries: the entries the server state may hold besides :meth:`setup`'s, as templates: ``{key}`` an
            entry of the initial server state (the added entry is a tensor of its dtype and number of dimensions),
            ``{module}`` a target module's name, ``{client}`` a client index, ``{n}`` a count (FedALT's
            ``"upload.{client}/{module}.lora_A"``); ``client_entries`` the same for a client's state besides
            :meth:`init_client`'s (a composed correction declares its own). Every checkpoint's states are checked
            against them before use (``runtime/checkpoint.py``, :meth:`state_entries`).
        upload_entries: the names of the tensors a reply may hold, as templates of the same kind (default
            ``("{key}",)``: named as entries of the initial server state, as LoRA factors and the head are; a
            composed correction adds its own, SCAFFOLD's ``"scaffold.dc/{key}"``); the uplink's error feedback keeps a
            residual per reply tensor in the client's state, under ``"uplink.residual/"`` and the tensor's name
            (:meth:`upload_templates`).
        exact_entries: shell-style patterns (``fnmatch``) of the floating tensors of its messages, either way, that a
            lossy codec must send exactly (``docs/codecs.md``): those whose error the method cannot absorb, such as an
            increment a client adds to a copy of the model it keeps (SSF's ``"sync/*"``). Default: none; integer and
            boolean tensors and scalars always travel exactly.
        batched: True if the method has a vectorised round, :meth:`batched_round` (for closed-form tasks,
            ``run.vectorized``); the vectorised runner refuses the others.
        optimizers: the ``train.optimizer`` values the method's local step allows (``()``: any), with
            ``optimizer_refusal`` saying why; checked at config time (:meth:`optimizer_requirement`).
        max_server_lr: the largest ``server.lr`` the server step allows (``None``: any), with
            ``server_lr_refusal`` saying why; checked at config time.
    """

    prefix = "method"
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    uplink: ClassVar[str] = ""
    downlink: ClassVar[str] = ""
    needs_individual_replies: ClassVar[bool] = False
    supports_heterogeneous_ranks: ClassVar[bool] = False
    heterogeneous_ranks_refusal: ClassVar[str] = ""
    supports_cohorts: ClassVar[bool] = False
    reads_features: ClassVar[bool] = False
    personalized: ClassVar[bool] = False
    preset: ClassVar[dict[str, Any]] = {}
    lr_grid: ClassVar[tuple[float, ...]] = ()
    privacy_modes: ClassVar[tuple[str, ...] | None] = None
    privacy_refusal: ClassVar[str] = ""
    reference: ClassVar[str] = ""
    communicates: ClassVar[bool] = True
    pooled: ClassVar[bool] = False
    per_client_downlink: ClassVar[bool] = False
    client_state: ClassVar[str] = ""
    server_entries: ClassVar[tuple[str, ...]] = ()
    client_entries: ClassVar[tuple[str, ...]] = ()
    upload_entries: ClassVar[tuple[str, ...]] = ("{key}",)
    exact_entries: ClassVar[tuple[str, ...]] = ()
    batched: ClassVar[bool] = False
    optimizers: ClassVar[tuple[str, ...]] = ()
    optimizer_refusal: ClassVar[str] = ""
    max_server_lr: ClassVar[float | None] = None
    server_lr_refusal: ClassVar[str] = ""

    info: SetupInfo

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "supports_cohorts" in cls.__dict__:
            raise TypeError(f"{cls.__name__}: supports_cohorts is derived (a method trains in cohorts when it has "
                            f"the two phases prepare_fit and finish_fit and keeps Method.train), not declared")
        cls.supports_cohorts = cls.train is Method.train and cls.prepare_fit is not Method.prepare_fit

    @classmethod
    def supported_privacy_modes(cls) -> tuple[str, ...]:
        """``privacy_modes``, or ``("local",)`` for methods needing individual replies and ``("central", "local")``
        for those whose server step takes weighted sums only."""
        if cls.privacy_modes is not None:
            return cls.privacy_modes
        return ("local",) if cls.needs_individual_replies else ("central", "local")

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        """Attach adapters to ``model`` and return the initial server state. Deterministic given ``info``."""
        raise NotImplementedError

    def optimizer_requirement(self) -> tuple[tuple[str, ...], str]:
        """(the ``train.optimizer`` values allowed with these options, why): ``optimizers`` and
        ``optimizer_refusal`` unless an option narrows them (FedGaLore's ``state_sync``)."""
        return self.optimizers, self.optimizer_refusal

    def keeps_client_state(self) -> bool:
        """Whether a client's state persists across rounds with these options: the method's own
        (``client_state``) or a composed correction's (SCAFFOLD's control variate)."""
        return bool(self.client_state) or any(c.client_state for c in self.composed_corrections())

    def state_entries(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(server, client)``: the templates of the entries the server and a client state may hold besides the
        initial ones, the method's own and its composed corrections' (``server_entries``, ``client_entries``)."""
        corrections = self.composed_corrections()
        return (self.server_entries + tuple(t for c in corrections for t in c.server_entries),
                self.client_entries + tuple(t for c in corrections for t in c.client_entries))

    def upload_templates(self) -> tuple[str, ...]:
        """The templates of a reply's tensor names: the method's own and its composed corrections'
        (``upload_entries``)."""
        return self.upload_entries + tuple(t for c in self.composed_corrections() for t in c.upload_entries)

    def init_client(self, client: int) -> State:
        """Initial state of client ``client`` before its first round (the ``client_state`` declared; default:
        empty). Deterministic given ``info`` and ``client``: the simulator and a Flower node make the same."""
        return State()

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        """What client ``client`` receives in round ``rnd``: one message per client, equal for equally ranked
        clients unless ``per_client_downlink``."""
        raise NotImplementedError

    def train(self, model: AdaptedModel, msg: Message, state: State, trainer) -> tuple[Message, State]:
        """Load ``msg`` into ``model``, train with ``trainer.fit(...)``, return (reply, new client state). The
        reply must carry ``num_examples`` (``trainer.num_examples``) and ``train_loss``.

        Default: :meth:`prepare_fit`, ``trainer.fit`` of what it prepared, :meth:`finish_fit`. A method that
        overrides ``train`` instead trains one client at a time (``supports_cohorts``)."""
        fit = self.prepare_fit(model, msg, state, trainer)
        return self.finish_fit(fit, trainer.fit(fit.model, fit.params, fit.corrections, fit.optimizer), trainer)

    def prepare_fit(self, model: AdaptedModel, msg: Message, state: State, trainer) -> Fit:
        """The first phase of :meth:`train`: load ``msg`` (and ``state``) into ``model`` and return the client's
        :class:`~fedlowrank.training.local.Fit` (the adapter and head parameters to train, now ``model``'s only
        trainable ones; this fit's own corrections, started; what :meth:`finish_fit` reads). It changes nothing
        of the method itself: a cohort prepares several clients' fits before it finishes any."""
        raise NotImplementedError

    def finish_fit(self, fit: Fit, result: FitResult, trainer) -> tuple[Message, State]:
        """The second phase of :meth:`train`: from the trained ``fit`` and its ``result``, the reply (with
        ``num_examples`` and ``train_loss``) and the client's new state."""
        raise NotImplementedError

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        raise NotImplementedError

    def load_global(self, model: AdaptedModel, server: State) -> None:
        """Put the global model into ``model`` for evaluation on the global test set."""
        raise NotImplementedError

    def load_personal(self, model: AdaptedModel, server: State, state: State) -> None:
        """Put client-specific model (global part + the client's private state) into ``model``."""
        self.load_global(model, server)

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The tensors an honest reply to ``down`` (what client ``k`` was sent in round ``rnd``) carries, each with
        its shape and dtype, exactly: the runtime rejects a reply with a missing, extra, differently shaped or typed
        tensor (:func:`fedlowrank.runtime.engine.check_reply`). Shapes follow the client's rank; tensors that come
        back trained are declared from ``down`` (:func:`specs_of`), the others from what :meth:`setup` saw."""
        raise NotImplementedError

    def chosen_upload_spec(self, down: Message, reply: Message) -> Upload:
        """Tensors whose number an honest client chooses (e.g. one per basis segment of its local steps), declared
        from what ``reply`` says it holds; raises ``ValueError`` (the reason) when that is malformed. Default: none."""
        return {}

    def unequal_replies(self) -> str:
        """Why honest replies of one round may differ in tensors or shapes with these options, or ``""`` when they
        never do (at equal ranks). Central DP and robust aggregation, which combine replies coordinate by
        coordinate, are refused at config time when it is not empty."""
        return ""

    def batched_round(self, model: AdaptedModel, server: State, clients: np.ndarray, oracle, rnd: int) -> State:
        """The vectorised runner's round (declared by ``batched``): the sampled ``clients [S]`` train on
        ``oracle``'s closed-form minibatch gradients (:mod:`fedlowrank.runtime.vectorized`) and the server steps;
        returns the new server state."""
        raise NotImplementedError(f"method {self.name!r} has no vectorised round (batched = False)")

    def protocol_messages(self, down: Message, reply: Message) -> tuple[list[Message], list[Message]] | None:
        """The messages (down, up) the method's own protocol exchanges with a client in a round, where that differs
        from the one exchange the runtime runs (FedASK's two uploads, whose second stage the server computes from
        the reply): the ledger counts their sizes (:class:`~fedlowrank.runtime.rounds.RoundReplies`), which the
        byte format makes independent of the values. ``None`` (default): ``down`` and ``reply`` themselves."""
        return None

    def max_reply_bytes(self, down: Message) -> int:
        """Upper bound on an honest reply's serialised size; larger replies are rejected."""
        return 2 * down.nbytes() + (1 << 20)

    def report(self, **metrics: float) -> None:
        """Record diagnostics of the current server step (floats); the runtime logs them with the round."""
        self.__dict__.setdefault("_metrics", {}).update(metrics)

    def pop_metrics(self) -> dict[str, float]:
        """The diagnostics recorded since the last call (called by the runtime after each aggregate)."""
        return self.__dict__.pop("_metrics", {})

    # -- shared helpers ------------------------------------------------------------------------------
    def composed_corrections(self) -> list[ClientCorrection]:
        """The client corrections composed on this method (:class:`Corrected`'s ``correction`` option; none
        here)."""
        return []

    def reply(self, params: dict[str, nn.Parameter], keys: Iterable[str], extra: dict[str, Any], trainer,
              loss: float) -> Message:
        """The reply: ``params[k]`` for ``k`` in ``keys``, the corrections' ``extra`` entries, ``num_examples``
        and ``train_loss``."""
        with torch.no_grad():  # a copy outside autograd: one operation per tensor
            msg = Message({k: params[k].clone() for k in keys})
        msg.update(extra)
        msg["num_examples"] = int(trainer.num_examples)
        msg["train_loss"] = float(loss)
        return msg

    @classmethod
    def listed_options(cls) -> dict[str, Declared]:
        """The options ``fedlowrank methods NAME`` lists: those that can change what the method does."""
        return declared(cls)

    @classmethod
    def options(cls) -> dict[str, Any]:
        """The method's options with their defaults."""
        if not dataclasses.is_dataclass(cls):
            return {}
        return {name: d.default for name, d in declared(cls).items()}

    def client_weights(self, replies: Sequence[Reply]) -> torch.Tensor:
        """pₖ over the replies: proportional to data size or uniform (``info.weighting``); sums to 1. [K]"""
        return torch.from_numpy(self.weights_of([r.num_examples for r in replies]))

    def weights_of(self, counts: Sequence[int]) -> np.ndarray:
        """pₖ of clients holding ``counts`` examples (see :meth:`client_weights`), float64. [K]"""
        w = np.ones(len(counts)) if self.info.weighting == "uniform" else np.asarray(counts, dtype=np.float64)
        return w / w.sum()

    def server_step(self, old: torch.Tensor, avg: torch.Tensor) -> torch.Tensor:
        """Scaled averaging (Task-Arithmetic style): ``old + β·(avg − old)``; β = ``info.server_lr``."""
        beta = self.info.server_lr
        return avg if beta == 1.0 else old + beta * (avg - old)

    def average_into(self, server: State, replies: Sequence[Reply], keys: Iterable[str], weights: torch.Tensor) -> None:
        """``server[key] ← server_step(server[key], Σₖ pₖ reply_k[key])`` for each key."""
        keys = list(keys)
        if not keys:
            return
        for key, avg in zip(keys, weighted_sums([[r.message[k] for k in keys] for r in replies], weights)):
            server[key] = self.server_step(server[key], avg)


def weighted_sums(rows: Sequence[Sequence[torch.Tensor]], weights: torch.Tensor) -> list[torch.Tensor]:
    """``[Σₖ wₖ rows[k][i] for each i]``: the tensors of K rows (one per reply, equal in shapes) weighted and summed,
    accumulated in float64 (one multi-tensor add per row, not one per tensor) and cast back to row 0's dtypes."""
    acc = [torch.zeros_like(t, dtype=torch.float64) for t in rows[0]]
    for row, w in zip(rows, weights.tolist()):
        torch._foreach_add_(acc, list(row), alpha=w)
    return [a.to(t.dtype) for a, t in zip(acc, rows[0])]


def weighted_sum(tensors: Iterable[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Σₖ wₖ tₖ (:func:`weighted_sums` of one tensor per row)."""
    return weighted_sums([[t] for t in tensors], weights)[0]


def head_tensors(model: AdaptedModel) -> dict[str, torch.Tensor]:
    """The head's parameters as message entries ``"head/<param name>"``."""
    return {f"head/{n}": p.detach().clone() for n, p in model.head_parameters().items()}


def on_host(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of a model tensor, to combine with message or state tensors (which live on the CPU
    while the model may be on an accelerator; see :mod:`fedlowrank.device`)."""
    return t.detach().to("cpu", copy=True)


def load_head(model: AdaptedModel, msg: Message) -> None:
    with torch.no_grad():
        for n, p in model.head_parameters().items():
            p.copy_(msg[f"head/{n}"])


@dataclass
class Corrected(Method):
    """A method whose client composes the drift corrections of :mod:`fedlowrank.training.corrections`: the one
    declaration of the options ``correction``, ``mu`` and ``cv_grad``. A subclass narrows ``correction`` with
    :func:`correction_option` (its default, allowed values and why); the corrections are made once, here, and a
    method that adds its own (MOON's contrastive term, ILoRA-S's variates) appends to ``_corrections`` in its
    ``__post_init__``.
    """

    correction: str = correction_option()
    mu: float = mu_option()
    cv_grad: str = cv_grad_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        self._corrections: list[ClientCorrection] = make_corrections(self.correction, self.mu, self.cv_grad)

    @classmethod
    def listed_options(cls) -> dict[str, Declared]:
        """Without ``mu`` where no allowed correction has FedProx's term, nor ``cv_grad`` where none has SCAFFOLD's
        variates (the method's narrowed ``correction``)."""
        allowed = declared(cls)["correction"].setting.allowed() or ()
        unused = {option for option, part in (("mu", "fedprox"), ("cv_grad", "scaffold")) if not composes(allowed, part)}
        return {k: d for k, d in declared(cls).items() if k not in unused}

    def composed_corrections(self) -> list[ClientCorrection]:
        return self._corrections

    def correction_broadcast(self, server: State, msg: Message) -> Message:
        """``msg`` plus what the corrections send down (e.g. SCAFFOLD's control variate)."""
        for c in self.composed_corrections():
            msg.update(c.broadcast(server))
        return msg

    def with_corrections(self, down: Message, trained: Upload) -> Upload:
        """``trained`` (what the client trains and sends back) plus what the composed corrections add to a reply
        (e.g. SCAFFOLD's ``scaffold.dc/<key>`` of each trained tensor's spec)."""
        out = dict(trained)
        for c in self.composed_corrections():
            out.update(c.upload_spec(down, trained))
        return out

    def corrected_fit(self, model: AdaptedModel, msg: Message, state: State,
                      params: dict[str, nn.Parameter]) -> Fit:
        """The :class:`~fedlowrank.training.local.Fit` of ``params`` of ``model`` (already loaded from ``msg``)
        with the composed corrections (:func:`~fedlowrank.training.corrections.corrected_fit`)."""
        return corrected_fit(self.composed_corrections(), model, msg, state, params)

    def finish_fit(self, fit: Fit, result: FitResult, trainer) -> tuple[Message, State]:
        """The corrections' ``finish`` hooks; the reply with every trained tensor and their entries, and the
        client's new state."""
        extra = finish_corrections(fit, result)
        return self.reply(fit.params, fit.params, extra, trainer, result.loss), fit.state

    def fit_and_reply(self, model: AdaptedModel, msg: Message, state: State, trainer,
                      params: dict[str, nn.Parameter]) -> tuple[Message, State]:
        """Train ``params`` of ``model`` (already loaded from ``msg``) with the composed corrections and reply with
        all of them, in one go (for a method with its own ``train``). Returns (reply, new client state)."""
        fit = self.corrected_fit(model, msg, state, params)
        return self.finish_fit(fit, trainer.fit(fit.model, fit.params, fit.corrections, fit.optimizer), trainer)


@dataclass
class LoRAMethod(Corrected):
    """Common machinery of methods that train LoRA factors on the target modules (FedIT and its family).

    Message keys: ``"<module>.lora_A"`` ``[r, in]``, ``"<module>.lora_B"`` ``[out, r]``, ``"head/<param>"``,
    ``"<module>.base_delta"`` ``[out, in]`` (only when the method keeps a non-zero base delta). Keys of
    composed pieces are namespaced with a slash (``"scaffold.c/<key>"``); plain keys never contain one.

    Client cohorts (``supports_cohorts``): the two phases are :meth:`local_fit` (load the message, the fit of
    the factors and head with the corrections) and :meth:`Corrected.finish_fit` (reply with all of them); a member
    of the family that does more before or after (FedSA-LoRA's private B, FLoRA's fresh factors, FedRot-LoRA's
    alignment...) overrides the phases, not ``train``, and so trains in cohorts too.

    Options shared by every LoRA method: :class:`Corrected`'s ``correction``, ``mu`` and ``cv_grad``.
    """

    trains: ClassVar[tuple[str, ...]] = ("A", "B")
    upload_entries = ("{module}.lora_A", "{module}.lora_B", "head/{head}")

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        self.info = info
        attach_lora(model, info.rank, info.alpha, info.scaling, info.dropout)
        self.record_factors(model)
        server = State()
        gen = torch_generator(info.seed, "lora-init")
        for name, mod in lora_modules(model).items():
            A, B = init_lora_factors(mod.out_features, mod.in_features, info.rank, gen, mod.base.weight.dtype)
            server[f"{name}.lora_A"], server[f"{name}.lora_B"] = A, B
        server.update(head_tensors(model))
        for c in self._corrections:
            c.init_server(server, self.trainable_keys(model))
        return server

    def record_factors(self, model: AdaptedModel) -> None:
        """Remember each LoRA module's ``(out, in, factor dtype)`` for :meth:`factor_specs` (at set-up)."""
        self._factors = {n: (m.out_features, m.in_features, m.lora_A.dtype) for n, m in lora_modules(model).items()}

    def factor_specs(self, rank: int) -> Upload:
        """``<module>.lora_A [rank, in]`` and ``<module>.lora_B [out, rank]`` of every LoRA module, for factors a
        client trains without receiving them."""
        specs: Upload = {}
        for name, (out, inp, dtype) in self._factors.items():
            specs[f"{name}.lora_A"] = TensorSpec((rank, inp), dtype)
            specs[f"{name}.lora_B"] = TensorSpec((out, rank), dtype)
        return specs

    def trainable_keys(self, model: AdaptedModel) -> dict[str, tuple[int, ...]]:
        """Names and shapes of what clients train: factors in ``trains`` plus the head (global rank)."""
        keys: dict[str, tuple[int, ...]] = {}
        for name, mod in lora_modules(model).items():
            if "A" in self.trains:
                keys[f"{name}.lora_A"] = (self.info.rank, mod.in_features)
            if "B" in self.trains:
                keys[f"{name}.lora_B"] = (mod.out_features, self.info.rank)
        keys.update({f"head/{n}": tuple(p.shape) for n, p in model.head_parameters().items()})
        return keys

    # -- client side -----------------------------------------------------------------------------------
    def load_message(self, model: AdaptedModel, msg: Message) -> None:
        """Load factors (together: :func:`~fedlowrank.adapters.lora.load_factors`), base deltas and head from a
        message into the model."""
        modules = lora_modules(model)
        load_factors(list(modules.values()), [(msg[f"{name}.lora_A"], msg[f"{name}.lora_B"]) for name in modules])
        for name, mod in modules.items():
            mod.set_base_delta(msg.get(f"{name}.base_delta"))
        load_head(model, msg)

    def trainable(self, model: AdaptedModel, factors: Iterable[str]) -> dict[str, nn.Parameter]:
        """``{"<module>.lora_A": Parameter, ..., "head/<p>": Parameter}`` for the given factors."""
        params: dict[str, nn.Parameter] = {}
        for name, mod in lora_modules(model).items():
            if "A" in factors:
                params[f"{name}.lora_A"] = mod.lora_A
            if "B" in factors:
                params[f"{name}.lora_B"] = mod.lora_B
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        return params

    def factors_to_train(self, rnd: int) -> tuple[str, ...]:
        return self.trains

    def local_fit(self, model: AdaptedModel, msg: Message, state: State, factors: Iterable[str]) -> Fit:
        """Load ``msg``; the :class:`~fedlowrank.training.local.Fit` of ``factors`` + head with the composed
        corrections."""
        self.load_message(model, msg)
        return self.corrected_fit(model, msg, state, self.trainable(model, factors))

    def local_result(self, fit: Fit, result: FitResult) -> tuple[dict[str, nn.Parameter], Message, State, float]:
        """After :meth:`local_fit`'s fit: (trained params, extra reply entries from the corrections, new client
        state, mean train loss)."""
        return fit.params, Message(finish_corrections(fit, result)), fit.state, result.loss

    def local_train(self, model: AdaptedModel, msg: Message, state: State, trainer,
                    factors: Iterable[str]) -> tuple[dict[str, nn.Parameter], Message, State, float]:
        """Load ``msg``, train ``factors`` + head with the composed corrections, in one go (:meth:`local_fit`,
        ``trainer.fit``, :meth:`local_result`; a method with its own ``train``).

        Returns (trained params, extra reply entries from corrections, new client state, mean train loss).
        """
        fit = self.local_fit(model, msg, state, factors)
        return self.local_result(fit, trainer.fit(fit.model, fit.params, fit.corrections, fit.optimizer))

    def prepare_fit(self, model: AdaptedModel, msg: Message, state: State, trainer) -> Fit:
        """FedIT's client: the factors in ``trains`` and the head (the reply: all of them)."""
        return self.local_fit(model, msg, state, self.trains)

    # -- server side -----------------------------------------------------------------------------------
    def aggregate_corrections(self, server: State, replies: Sequence[Reply]) -> None:
        for c in self._corrections:
            c.aggregate(server, replies, self.info.num_clients)

    def global_tensors(self, server: State, keys: Iterable[str]) -> Message:
        return Message({k: server[k] for k in keys})

    def lora_keys(self, server: State, factors: Iterable[str] = ("A", "B")) -> list[str]:
        suffixes = tuple(f".lora_{f}" for f in factors)
        return [k for k in server if k.endswith(suffixes) and "/" not in k]  # "ns/..." keys belong to others

    def head_keys(self, server: State) -> list[str]:
        return [k for k in server if k.startswith("head/")]

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The factors trained this round as they were sent (the client's rank), the head, and the corrections'
        uploads."""
        factors = tuple(f".lora_{f}" for f in self.factors_to_train(rnd))
        trained = [k for k in down.tensors() if (k.endswith(factors) and "/" not in k) or k.startswith("head/")]
        return self.with_corrections(down, specs_of(down, trained))

    def load_global(self, model: AdaptedModel, server: State) -> None:
        self.load_message(model, Message(server))


__all__ = ["Method", "Corrected", "LoRAMethod", "SetupInfo", "TensorSpec", "Upload", "specs_of", "correction_option",
           "cv_grad_option", "mu_option", "weighted_sum",
           "head_tensors", "load_head", "on_host"]
