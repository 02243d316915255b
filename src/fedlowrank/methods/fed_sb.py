"""Fed-SB (Singhal, Ponkshe, Vartak, Varshney, Vepakomma, "Fed-SB: A Silver Bullet for Extreme Communication
Efficiency and Performance in (Private) Federated LoRA Fine-Tuning", arXiv:2502.15436).

Per target linear, ``ΔW = B R A`` (:class:`~fedlowrank.adapters.ravan.CoreLinear`): ``B: [out, r]`` and
``A: [r, in]`` frozen and shared by every client, only the core ``R: [r, r]`` (and the head) trained. Because the
bases are common, ``Σₖ pₖ B Rₖ A = B (Σₖ pₖ Rₖ) A``: averaging the cores is exact, and a reply is ``r²`` numbers
per module whatever ``in`` and ``out``. There is no α/r factor (the official code sets α = r, so s = 1).

Server, per module: ``R ← server_step(R, Σₖ pₖ Rₖ)`` (β, ``server.lr``); the head is averaged as FedIT's.

Bases (``method.init``):

* ``gradient`` (the paper's): the first round is the initialisation exchange. Each sampled client runs its round's
  local steps at ``W0`` without moving anything and uploads ``Gₖ = Σ_steps ∇_W L`` ``[out, in]`` per module (the
  step gradients as its optimizer would see them: clipped by ``train.max_grad_norm``, DP-SGD's noisy clipped means
  under ``privacy.dpsgd``). The server forms ``Ĝ = −η·sign(Σₖ Gₖ)`` (an Adam-like first step of size
  ``η = method.init_step``), its thin SVD ``Ĝ = U Σ Vᵀ``, and sets ``B = U_{:r}``, ``A = V_{:r}ᵀ``, ``R⁰ = Σ_{:r}``,
  so that ``B R⁰ A`` is the best rank-r approximation of ``Ĝ``: the model starts one virtual step from ``W0``.
  The bases then go down with every message (a client may be sampled for the first time in any round).
* ``random``: ``B`` with orthonormal columns and ``A`` with orthonormal rows from the run seed (every party derives
  them, they never travel) and ``R⁰ = 0``, so the first model is ``W0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..adapters.model import AdaptedModel, matrix_shape
from ..adapters.ravan import CoreLinear, ravan_bases, ravan_modules
from ..linalg.lowrank import normalize_svd_signs
from ..message import Message, State
from ..schema import setting
from ..seeding import torch_generator
from ..training.local import Fit
from . import register
from .base import Method, SetupInfo, TensorSpec, Upload, head_tensors, load_head, on_host, specs_of

INITS = ("gradient", "random")


def core_key(name: str) -> str:
    """The message key of target ``name``'s core ``R: [r, r]``."""
    return f"{name}.fedsb_R"


def bases_keys(name: str) -> tuple[str, str]:
    """The keys of target ``name``'s bases ``B: [out, r]``, ``A: [r, in]``."""
    return f"{name}.fedsb_B", f"{name}.fedsb_A"


def gradient_key(name: str) -> str:
    """The reply key of target ``name``'s summed gradient ``Gₖ: [out, in]`` (the initialisation round)."""
    return f"{name}.fedsb_G"


class GradientSum(torch.optim.Optimizer):
    """An optimizer that leaves its parameters where they are: each step adds their gradients to
    :meth:`total`, so a fit with it sums the gradients of its steps at one point."""

    def __init__(self, params):
        super().__init__(list(params), {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("sum", torch.zeros_like(p)).add_(p.grad)

    def total(self, p: nn.Parameter) -> torch.Tensor:
        """``Σ_steps ∇p`` (zeros when no step produced a gradient)."""
        return self.state[p]["sum"] if "sum" in self.state[p] else torch.zeros_like(p)


def initial_core(G: torch.Tensor, rank: int, step: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B: [out, r], R⁰: [r, r], A: [r, in])`` with ``B R⁰ A`` the rank-r truncated SVD of ``Ĝ = −step·sign(G)``:
    ``B`` and ``Aᵀ`` its leading singular vectors (signs by :func:`normalize_svd_signs`), ``R⁰`` the diagonal of its
    singular values (float64)."""
    U, S, Vh = torch.linalg.svd(-step * torch.sign(G.to(torch.float64)), full_matrices=False)
    U, Vh = normalize_svd_signs(U[:, :rank], Vh[:rank])
    return U, torch.diag(S[:rank]), Vh


@register
@dataclass
class FedSB(Method):
    name = "fed-sb"
    description = ("frozen shared B, A (SVD of a first sign-gradient step, or random); clients train and average an "
                   "r×r core R: exact, r² numbers up per module")
    paper = ("Singhal, Ponkshe, Vartak, Varshney, Vepakomma, Fed-SB: A Silver Bullet for Extreme Communication "
             "Efficiency and Performance in (Private) Federated LoRA Fine-Tuning (arXiv:2502.15436)")
    uplink = ("R_k [r,r] per target module, head; with method.init = gradient, the first round uploads the summed "
              "gradient G_k [out,in] per target module instead")
    downlink = ("R [r,r] per target module, head; with method.init = gradient also the bases B [out,r], A [r,in] "
                "(from the seed otherwise)")
    needs_individual_replies = False
    server_entries = ("{module}.fedsb_A", "{module}.fedsb_B", "{module}.fedsb_R")  # once round 1 made the bases
    heterogeneous_ranks_refusal = ("every client trains an r×r core between one shared pair of rank-r bases; the "
                                   "paper's mechanism for mixed ranks was not available")
    preset = {"train.optimizer": "adamw", "train.weight_decay": 0.0}  # official: AdamW, wd 0, lr 1e-4 (5e-4 DP)
    lr_grid = (1e-4, 3e-4, 1e-3, 3e-3)

    init: str = setting("gradient", "the frozen bases: gradient (the first round uploads each client's summed "
                        "gradient; B, A, R⁰ from the SVD of −init_step·sign(ΣG)) or random (orthonormal from the "
                        "seed, R⁰ = 0)", choices=INITS)
    init_step: float = setting(1e-4, "η of the virtual first step Ĝ = −η·sign(ΣG) (method.init = gradient; the "
                               "official η = lr/(warmup_ratio·total steps))", gt=0)

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        """Attach a :class:`CoreLinear` to every target. ``random``: bases from ``"fed-sb-bases"`` (keyed by target
        index), ``R = 0``; ``gradient``: no bases yet (the first round makes them)."""
        self.info = info
        model.attach(lambda name, lin: CoreLinear(lin, info.rank, info.dropout))
        self._shapes = {name: matrix_shape(m.base) for name, m in ravan_modules(model).items()}
        server = State(head_tensors(model))
        if self.init == "random":
            for name, (B, A) in self.seeded_bases().items():
                server[core_key(name)] = torch.zeros(info.rank, info.rank)
                server[bases_keys(name)[0]], server[bases_keys(name)[1]] = B, A
        return server

    def seeded_bases(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{target: (B [out, r], A [r, in])}``, orthonormal, from the run seed (``method.init = random``)."""
        out = {}
        for i, (name, (out_f, in_f)) in enumerate(self._shapes.items()):
            B, A = ravan_bases(out_f, in_f, 1, self.info.rank, "orthonormal",
                               torch_generator(self.info.seed, "fed-sb-bases", i))
            out[name] = (B[0], A[0])
        return out

    @staticmethod
    def initialised(msg) -> bool:
        """Whether ``msg`` (a server state or a message) holds the cores (else: the initialisation round)."""
        return any(k.endswith(".fedsb_R") for k in msg.tensors())

    # -- messages --------------------------------------------------------------------------------------
    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        """Before the bases exist: the head only. Then the cores and the head, plus the bases when they came from
        the clients' gradients."""
        keys = [k for k in server.tensors() if k.endswith(".fedsb_R") or k.startswith("head/")]
        if self.init == "gradient":
            keys += [k for k in server.tensors() if k.endswith((".fedsb_B", ".fedsb_A"))]
        return Message({k: server[k] for k in keys})

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The initialisation round: ``<module>.fedsb_G [out, in]`` float32 per module; then the cores
        ``<module>.fedsb_R [r, r]`` and the head, as sent."""
        if not self.initialised(down):
            return {gradient_key(name): TensorSpec(shape, torch.float32) for name, shape in self._shapes.items()}
        return specs_of(down, [k for k in down.tensors() if k.endswith(".fedsb_R") or k.startswith("head/")])

    def max_reply_bytes(self, down: Message) -> int:
        """Room for every declared tensor (the dense gradients of the initialisation round) and twice the download."""
        declared = sum(math.prod(s.shape) * s.dtype.itemsize for s in self.upload_spec(down, 0).values())
        return max(declared, 2 * down.nbytes()) + (1 << 20)

    # -- client side -----------------------------------------------------------------------------------
    def load(self, model: AdaptedModel, msg) -> None:
        """Bases (from ``msg``, or the seed's), cores and head into ``model``; before the bases exist, ``R = 0``."""
        seeded = self.seeded_bases() if self.init == "random" else {}
        for name, mod in ravan_modules(model).items():
            if self.initialised(msg):
                kb, ka = bases_keys(name)
                B, A = (msg[kb], msg[ka]) if self.init == "gradient" else seeded[name]
                mod.set_bases(B, A)
                mod.set_heads([msg[core_key(name)]])
            else:
                mod.set_heads([torch.zeros(self.info.rank, self.info.rank)])
        load_head(model, msg)

    def prepare_fit(self, model, msg, state, trainer):
        """One fit of the cores and the head (routed per member in a cohort); in the initialisation round, of a
        zero probe per target whose optimizer (:class:`GradientSum`) moves nothing and sums the gradients
        ``Gₖ = Σ_steps ∇_W L`` at the model as loaded (``W0``)."""
        self.load(model, msg)
        mods = ravan_modules(model)
        if not self.initialised(msg):
            probes = {gradient_key(name): mod.start_probe() for name, mod in mods.items()}
            model.set_trainable(probes)
            made: list[GradientSum] = []

            def summing(params: dict[str, nn.Parameter], lr: float) -> GradientSum:
                made.append(GradientSum(params.values()))
                return made[-1]
            return Fit(model, probes, optimizer=summing, msg=msg, state=state, carry={"sums": made, "mods": mods})
        params: dict[str, nn.Parameter] = {core_key(name): mod.cores[0] for name, mod in mods.items()}
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        model.set_trainable(params)
        return Fit(model, params, msg=msg, state=state)

    def finish_fit(self, fit, result, trainer):
        """The trained cores and head; in the initialisation round, each target's summed gradient ``Gₖ``."""
        if "sums" in fit.carry:
            up = Message({k: on_host(fit.carry["sums"][-1].total(p)) for k, p in fit.params.items()})
            for mod in fit.carry["mods"].values():
                mod.stop_probe()
        else:
            up = Message({k: on_host(p) for k, p in fit.params.items()})
        up["num_examples"], up["train_loss"] = int(trainer.num_examples), float(result.loss)
        return up, fit.state

    # -- server side -----------------------------------------------------------------------------------
    def aggregate(self, server, replies, rnd):
        new = State(server)
        if not self.initialised(server):
            gains = []
            for name in self._shapes:
                G = sum(r.message[gradient_key(name)].to(torch.float64) for r in replies)
                B, R0, A = initial_core(G, self.info.rank, self.init_step)
                kb, ka = bases_keys(name)
                new[kb], new[ka], new[core_key(name)] = B.float(), A.float(), R0.float()
                gains.append(float(R0.diagonal().pow(2).sum()))
            self.report(init_core_norm=sum(gains) ** 0.5)
            return new
        keys = [k for k in server.tensors() if k.endswith(".fedsb_R") or k.startswith("head/")]
        self.average_into(new, replies, keys, self.client_weights(replies))
        return new

    def load_global(self, model: AdaptedModel, server: State) -> None:
        self.load(model, Message(server))


__all__ = ["FedSB", "GradientSum", "initial_core", "core_key", "bases_keys", "gradient_key"]
