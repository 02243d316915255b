"""Heterogeneous-rank helpers shared by the LoRA methods (HetLoRA, FFA-LoRA, FedEx-LoRA, FlexLoRA, LoRA-FAIR,
ILoRA, FedIT+QR): slicing a server factor to a client's rank, zero-padding a client's factor to the server's,
and expressing every exchange at the server's LoRA scale (``ρ_k = s_k / s``; exactly 1.0 at equal ranks, so the
heterogeneous path equals the homogeneous one bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..adapters.lora import lora_scale
from ..linalg.lowrank import factored_svd, stack_factors
from ..message import Message, Reply, State
from .base import LoRAMethod, SetupInfo, weighted_sum


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (a message holds exactly its slice, never a view of the server state)."""
    return t.clone(memory_format=torch.contiguous_format)


def leading(key: str, t: torch.Tensor, r: int) -> torch.Tensor:
    """The leading ``r`` directions of a LoRA-shaped entry: rows of ``*lora_A`` ``[·, in]``, columns of
    ``*lora_B`` ``[out, ·]``; other entries unchanged (copied)."""
    if key.endswith("lora_A"):
        t = t[:r]
    elif key.endswith("lora_B"):
        t = t[:, :r]
    return copy(t)


def zero_pad(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` in the leading corner of a zero tensor of ``shape`` (rank-``r_k`` factor → server rank)."""
    out = t.new_zeros(tuple(shape))
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def scale_ratio(info: SetupInfo, rank: int) -> float:
    """``ρ = s_rank / s_server``: a client's LoRA scale over the server's (exactly 1.0 at the server rank)."""
    if rank == info.rank:
        return 1.0
    return lora_scale(info.alpha, rank, info.scaling) / lora_scale(info.alpha, info.rank, info.scaling)


def module_names(keys: Iterable[str]) -> list[str]:
    """Target module names, from the ``"<module>.lora_A"`` keys among ``keys`` (in order; ``"ns/…"`` keys of
    corrections and the head excluded)."""
    return [k[: -len(".lora_A")] for k in keys if k.endswith(".lora_A") and "/" not in k]


def download_factors(server: State, keys: Iterable[str], info: SetupInfo, client: int,
                     exponent: float = 0.5) -> Message:
    """Client ``client``'s leading-``r_k`` slices of the server factors ``keys``, times ``ρ_k^{-exponent}``.

    ``exponent = 0.5`` when both factors carry the rescaling, ``1.0`` when only B does (A frozen, FFA-LoRA).
    Slices are contiguous copies: the message holds, and the ledger counts, only ``r_k`` directions.
    """
    r = info.client_ranks[client]
    c = scale_ratio(info, r) ** -exponent
    return Message({k: leading(k, server[k], r) * c for k in keys})          # c = 1.0 (equal ranks) is exact


def rank_weights(replies: Sequence[Reply], info: SetupInfo, weights: torch.Tensor,
                 exponent: float = 0.5) -> torch.Tensor:
    """``pₖ ρ_k^{exponent}``: the weights of the zero-padded average at the server's scale. ``[K]`` float64."""
    rho = torch.tensor([scale_ratio(info, info.client_ranks[r.client]) for r in replies], dtype=torch.float64)
    return weights * rho ** exponent                                          # exact when every ρ is 1.0


def padded_average(replies: Sequence[Reply], key: str, shape: Sequence[int], weights: torch.Tensor) -> torch.Tensor:
    """``Σₖ wₖ pad(reply_k[key])`` with each factor zero-padded to the server ``shape``."""
    return weighted_sum((zero_pad(r.message[key], shape) for r in replies), weights)


def product_svd(server: State, replies: Sequence[Reply], name: str, weights: torch.Tensor,
                info: SetupInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``(U, S, Vh)`` of target ``name``'s aggregate product (:func:`product_factors`), factored
    (:func:`~fedlowrank.linalg.lowrank.factored_svd`, float64)."""
    return factored_svd(*product_factors(server, replies, name, weights, info))


def product_factors(server: State, replies: Sequence[Reply], name: str, weights: torch.Tensor,
                    info: SetupInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_c: [out, R], A_c: [R, in])`` with ``B_c A_c = ΔW = (1 − β) s B A + β Σₖ pₖ sₖ Bₖ Aₖ``, target ``name``'s
    aggregate product: the old global adapter ``(B, A)`` of ``server`` at the server scale ``s``, client k's factors
    at its own scale ``sₖ``, β = ``info.server_lr`` (:func:`~fedlowrank.linalg.lowrank.stack_factors`, float64)."""
    ka, kb = f"{name}.lora_A", f"{name}.lora_B"
    beta = info.server_lr
    Bs, As = [rep.message[kb] for rep in replies], [rep.message[ka] for rep in replies]
    w = [beta * float(pk) * lora_scale(info.alpha, info.client_ranks[rep.client], info.scaling)
         for pk, rep in zip(weights, replies)]
    if beta != 1.0:
        Bs, As = Bs + [server[kb]], As + [server[ka]]
        w = w + [(1.0 - beta) * lora_scale(info.alpha, info.rank, info.scaling)]
    return stack_factors(Bs, As, w)


def set_balanced(server: State, name: str, U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, k: int,
                 scale: float) -> None:
    """``server``'s factors of target ``name`` from the first ``k`` components of ``U diag(S) Vh`` split evenly,
    ``B = U_{:k} (S_{:k}/s)^{1/2}``, ``A = (S_{:k}/s)^{1/2} Vh_{:k}`` (so ``s B A`` is the rank-k truncation; ``s`` =
    ``scale``), zero-padded to the server rank and in the server factors' dtype."""
    ka, kb = f"{name}.lora_A", f"{name}.lora_B"
    root = (S[:k] / scale).sqrt()
    server[kb] = zero_pad((U[:, :k] * root).to(server[kb].dtype), server[kb].shape)
    server[ka] = zero_pad((root[:, None] * Vh[:k]).to(server[ka].dtype), server[ka].shape)


def refuse_scaffold_with_hetero_ranks(method: LoRAMethod, info: SetupInfo) -> None:
    """SCAFFOLD's control variates live at the server rank; with per-client ranks their shapes would not match."""
    if info.heterogeneous_ranks and "scaffold" in method.correction:
        raise ValueError(f"method.correction: {method.name!r} with heterogeneous ranks (lora.ranks) allows "
                         f"'none' or 'fedprox', got {method.correction!r}")


@dataclass
class HeteroRankLoRA(LoRAMethod):
    """Base of the LoRA methods whose clients may hold their own ranks: SCAFFOLD refused with mixed ranks, and
    each client downloads the leading ``r_k`` directions of the server factors at the server's scale."""

    supports_heterogeneous_ranks = True

    def setup(self, model, info: SetupInfo) -> State:
        refuse_scaffold_with_hetero_ranks(self, info)
        return super().setup(model, info)

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = download_factors(server, self.lora_keys(server), self.info, client)
        msg.update(self.global_tensors(server, self.head_keys(server)))
        return self.correction_broadcast(server, msg)
