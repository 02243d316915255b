"""What the server does to the replies before ``method.aggregate``, in one place for both runtimes.

Nothing a client sends may capture the global model. Each transform below maps the round's usable replies (sorted by
client) to the replies the method aggregates, like central DP (:func:`fedlowrank.privacy.runtime.central_replies`),
which runs last:

1. :func:`outlying_replies` (``server.outlier_ratio`` = k, 10 by default; off when ``inf`` and under central DP,
   whose clipping bounds every reply and whose accounting knows no rule that looks at the other replies): a reply
   whose update norm per local step (each floating tensor minus what the client was sent,
   :mod:`fedlowrank.privacy.mechanisms`, over the steps its ``num_examples`` gives: with ``train.local_epochs`` a
   larger client takes more steps) exceeds k times its *reference* is rejected, with the reason. The reference is
   the median of the round's other replies (a leave-one-out median, so that with two replies a huge one is measured
   against the honest one; it holds while fewer than half of a round's replies are bad); for a round's only reply,
   the median norm per step of the replies the newest earlier round aggregated (``update_norm`` in its metrics row);
   and for the only reply of the run's first aggregated round, the norm of what the client starts from: the
   floating tensors it was sent, or when those are all zero (FedALT's first Rest-of-World) its initial client state
   (``method.init_client``, which every runtime's server can make): a step that moves the model by more than k times
   its own size. A lone reply is kept unmeasured only when both are all zeros.
2. :func:`matching_replies` (with a robust aggregate or central DP, which combine the replies coordinate by
   coordinate): replies whose floating-point tensors differ in names, shapes or dtypes from the most common
   signature of the round are rejected, with the reason.
3. :func:`bound_updates` (``server.update_clip`` = C, off when ``inf``): each reply's *update* (each floating tensor
   minus what the client was sent, :mod:`fedlowrank.privacy.mechanisms`) is scaled to L2 norm at most C; a reply
   within the bound is left as it is, bit for bit.
4. :func:`robust_replies` (``server.aggregate``): ``"median"`` (coordinate-wise median, Yin et al. 2018,
   "Byzantine-Robust Distributed Learning", arXiv:1803.01498) or ``"trimmed-mean"`` (coordinate-wise mean after
   dropping the ⌊β·n⌋ largest and smallest values, β = ``server.trim_fraction``, same paper). Every reply's floating
   tensors are replaced by that value, so that a server step that is a weighted mean of the replies,
   ``Σₖ pₖ·replyₖ`` with ``Σₖ pₖ = 1``, returns it (the weights no longer matter). Only methods that declare such a
   server step (``"central"`` among :meth:`~fedlowrank.methods.base.Method.supported_privacy_modes`: a fixed-weight
   sum of the replies) may use it; the others are refused when the config is read
   (:func:`fedlowrank.config.checks.check_server`).

``"mean"`` (the default) and ``C = inf`` change nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

from ..linalg.reductions import total_norm
from ..message import Message, Reply
from ..privacy.mechanisms import clip_update, update_keys, update_norms
from ..privacy.runtime import central_replies
from ..training.local import steps_per_round


def signature(reply: Message) -> tuple:
    """Names, shapes and dtypes of a reply's floating-point tensors."""
    return tuple((k, tuple(reply[k].shape), str(reply[k].dtype)) for k in update_keys(reply))


def message_norm(msg: Message) -> float:
    """‖msg‖₂ over its floating-point tensors (float64), read once."""
    return total_norm([t.to(torch.float64) for t in msg.tensors().values() if t.is_floating_point()])


def outlying_replies(replies: list[Reply], downs: dict[int, Message], ratio: float, train,
                     earlier: float | None = None, initial: Callable[[int], Message] | None = None
                     ) -> tuple[list[Reply], list[dict[str, Any]], float | None]:
    """``(kept, rejected, norm)``: the replies whose update norm per local step (relative to ``downs[client]``, what
    each was sent; steps from ``train``, the ``[train]`` config, and the reply's ``num_examples``) is at most
    ``ratio`` times its reference (the module docstring: the median of the round's other replies; for a lone reply
    ``earlier``, the newest earlier aggregated round's median, else the norm of what it was sent or, when that is
    zero, of ``initial(client)``, its initial client state),
    ``{"client", "reason"}`` for each other one, and the median norm per step of the kept replies (``None``: none
    kept), the ``earlier`` of later rounds."""
    norms = [n / max(1, steps_per_round(train, r.num_examples))
             for n, r in zip(update_norms([(r.message, downs[r.client]) for r in replies]), replies)]
    kept, kept_norms, rejected = [], [], []
    for i, r in enumerate(replies):
        others = norms[:i] + norms[i + 1:]
        if others:
            reference, what = float(np.median(others)), "the median of the round's other replies"
        elif earlier:
            reference, what = earlier, "the median of the replies of the newest earlier round (a round's only reply)"
        else:
            reference = message_norm(downs[r.client]) or (message_norm(initial(r.client)) if initial else 0.0)
            reference, what = reference or math.inf, "the norm of what it starts from (a lone reply)"
        if norms[i] > ratio * reference:
            rejected.append({"client": r.client, "reason": f"update norm per local step {norms[i]:.4g} exceeds "
                             f"server.outlier_ratio = {ratio:g} times {reference:.4g}, {what}"})
        else:
            kept.append(r)
            kept_norms.append(norms[i])
    return kept, rejected, float(np.median(kept_norms)) if kept_norms else None


def earlier_update_norm(history: list[dict[str, Any]]) -> float | None:
    """The ``update_norm`` of the newest metrics row of ``history`` that has one (``None``: none has)."""
    return next((r["update_norm"] for r in reversed(history) if "update_norm" in r), None)


def outlier_ratio(cfg) -> float:
    """``server.outlier_ratio``, or ``inf`` (off) under central DP."""
    return math.inf if cfg.privacy.mode == "central" else cfg.server.outlier_ratio


def matching_replies(replies: list[Reply]) -> tuple[list[Reply], list[dict[str, Any]]]:
    """``(kept, rejected)``: the replies with the round's most common :func:`signature` (ties: the first client's),
    and ``{"client", "reason"}`` for each other one."""
    if not replies:
        return replies, []
    common = Counter(signature(r.message) for r in replies).most_common(1)[0][0]
    kept = [r for r in replies if signature(r.message) == common]
    rejected = [{"client": r.client, "reason": "its tensors differ in names, shapes or dtypes from the other "
                 "replies of the round"} for r in replies if signature(r.message) != common]
    return kept, rejected


def bound_updates(replies: list[Reply], downs: dict[int, Message], clip: float) -> tuple[list[Reply], dict[str, Any]]:
    """Each reply with its update scaled to L2 norm at most ``clip`` (relative to ``downs[client]``, what it was
    sent), and what to log: how many were scaled down and the largest norm."""
    out, norms = [], []
    for r in replies:
        msg, norm = clip_update(r.message, downs[r.client], clip)
        out.append(Reply(r.client, r.num_examples, msg))
        norms.append(norm)
    return out, {"update_clip": clip, "clipped": sum(n > clip for n in norms), "max_update_norm": max(norms)}


def coordinate_aggregate(stacked: torch.Tensor, kind: str, trim_fraction: float) -> torch.Tensor:
    """The coordinate-wise ``"median"`` or ``"trimmed-mean"`` of ``stacked`` [n, ...] over its first axis (float64)."""
    n = stacked.shape[0]
    ordered = stacked.to(torch.float64).sort(dim=0).values
    if kind == "median":
        return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    cut = math.floor(trim_fraction * n)
    return ordered[cut:n - cut].mean(dim=0)


def robust_replies(replies: list[Reply], kind: str, trim_fraction: float) -> list[Reply]:
    """The replies (of one :func:`signature`) with every floating tensor replaced by the coordinate-wise ``kind`` of
    that tensor over all of them (:func:`coordinate_aggregate`); other entries unchanged."""
    agreed = {}
    for key in update_keys(replies[0].message):
        tensors = [r.message[key] for r in replies]
        agreed[key] = coordinate_aggregate(torch.stack(tensors), kind, trim_fraction).to(tensors[0].dtype)
    out = []
    for r in replies:
        msg = Message(r.message)
        msg.update(agreed)
        out.append(Reply(r.client, r.num_examples, msg))
    return out


def server_replies(cfg, replies: list[Reply], downs: dict[int, Message], rnd: int,
                   history: list[dict[str, Any]]) -> tuple[list[Reply], dict[str, Any]]:
    """The replies ``method.aggregate`` gets (steps 3–4 of the module docstring, then central DP), and the round
    row's entries about them (``robust``, ``privacy``)."""
    notes: dict[str, Any] = {}
    s = cfg.server
    if math.isfinite(s.update_clip) and replies:
        replies, notes["robust"] = bound_updates(replies, downs, s.update_clip)
    if s.aggregate != "mean" and replies:
        replies = robust_replies(replies, s.aggregate, s.trim_fraction)
        notes.setdefault("robust", {})["aggregate"] = s.aggregate
    replies, privacy = central_replies(cfg, replies, downs, rnd, history)
    if privacy:
        notes["privacy"] = privacy
    return replies, notes


def needs_matching(cfg) -> bool:
    """Whether the server combines the replies coordinate by coordinate (robust aggregate, central DP)."""
    return cfg.server.aggregate != "mean" or cfg.privacy.mode == "central"
