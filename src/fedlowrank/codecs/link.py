"""One direction's codec at the message level: a :class:`~fedlowrank.message.Message` in, a coded ``Message`` out,
and back (``docs/codecs.md``).

A coded message is itself a message of the project's byte format (:mod:`fedlowrank.serialization`), so the ledger
counts exactly what is sent, headers, scales and indices included:

* its scalars are the message's, plus the header ``"@codec"``: the codec's options and the coded tensors in order,
  each as ``[name, dtype, shape]``;
* a tensor that stays exact travels as it is, under its own name: integer and boolean tensors, non-finite ones
  (which the reply checks then reject as they would uncoded), and those the method declares exact
  (``Method.exact_entries``, shell-style patterns such as ``"sync/*"``);
* every other floating tensor is coded, and each coded part is one flat tensor holding that part of every coded
  tensor in the header's order: ``"@v"`` (fp16/bf16 values; top-k's kept values), ``"@q"`` (level indices packed,
  each tensor's from a fresh byte), ``"@s"`` (bfloat16 block scales, each tensor's blocks its own) or ``"@i"``
  (top-k's indices, ascending, packed in ⌈log2 n⌉ bits, each tensor's from a fresh byte);
* with a lossless stage the whole coded message's bytes travel compressed, as the one uint8 tensor ``"@zlib"``,
  ``"@lzma"`` or ``"@zstd"``.

What is coded is the tensor's *update* where the receiver holds a reference for it, as privacy's clipping defines it
(:func:`fedlowrank.privacy.mechanisms.reference`): a reply tensor minus the broadcast tensor of the same name, shape
and dtype; otherwise (a broadcast, a tensor the client made) the tensor itself. Decoding adds the reference back
(float64, then the tensor's dtype), so a dropped entry of an update decodes to the broadcast value exactly.

Error feedback (uplink): the part of the update the codec dropped, ``e = u − sent`` with ``u = Δ + e_prev``, is kept in
the client's state under ``"uplink.residual/<name>"`` (float64 arithmetic, stored in the tensor's dtype) and added to
the next round's update of that tensor, so that over a client's rounds ``Σ sent + e = Σ Δ``. Stochastic rounding
draws from ``derive_seed(run.seed, "<direction>-codec", client, round)``, one stream per message, tensors in sorted
order: every runtime codes the same message into the same bytes, and a resumed run continues bit for bit.

:meth:`Link.decode` checks everything it reads (header, part names, dtypes and lengths, codes and indices in range,
scales finite, sizes within a bound) and raises :class:`~.lossless.CodecError` with the reason otherwise: a bad
coded reply is rejected like any bad reply.
"""

from __future__ import annotations

import fnmatch
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..message import Message, State
from ..privacy.mechanisms import reference as reference_of
from ..seeding import torch_generator
from ..serialization import FormatError
from .kernels import (NF4_LEVELS, dequantize_blocks, index_bits, pack_codes, packed_length, quantize_blocks, top_k,
                      topk_count, uniform_levels, unpack_codes)
from .lossless import CodecError, compress, decompress, require
from .settings import BITS, QUANTIZED, CodecSection, check_codec

HEADER = "@codec"  # the header scalar of a coded message
PART = "@"  # between a tensor's name and the name of one of its coded parts
RESIDUAL = "uplink.residual/"  # error feedback's entries in a client's state
_FLOATS = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
_VALUES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_OPTIONS = {"int8": ("block", "levels"), "int4": ("block", "levels"), "topk": ("topk_fraction", "topk_count", "values")}


def residual_entries(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Error feedback's residuals in a client ``state``: ``{tensor name: residual}``."""
    return {k[len(RESIDUAL):]: v for k, v in state.items() if k.startswith(RESIDUAL)}


def split_state(state: State) -> tuple[State, dict[str, torch.Tensor]]:
    """``(the method's own entries, the residuals)`` of a client's state: ``method.train`` gets the former only."""
    return State({k: v for k, v in state.items() if not k.startswith(RESIDUAL)}), residual_entries(state)


@dataclass
class Link:
    """The codec of one direction (``"uplink"`` or ``"downlink"``) of a run: ``section`` its config section,
    ``seed`` the run's seed, ``exact`` the patterns of the tensors the method declares exact
    (``Method.exact_entries``). :attr:`exact_seen` collects the exact floating tensors' patterns met so far, for the
    run's one line about them (:meth:`exact_line`); :attr:`seconds` the time spent coding and decoding in this
    process."""

    section: CodecSection
    direction: str
    seed: int = 0
    exact: tuple[str, ...] = ()
    exact_seen: dict[str, str] = field(default_factory=dict)  # pattern -> a tensor it matched
    seconds: float = 0.0
    _said: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        check_codec(self.section)
        require(self.section.lossless, f"{self.direction}.lossless")

    @property
    def active(self) -> bool:
        return self.section.active

    @property
    def error_feedback(self) -> bool:
        return self.section.feedback

    def describe(self) -> str:
        return self.section.describe()

    def options(self) -> dict[str, Any]:
        """What the header records of the codec's options (what decoding needs)."""
        s = self.section
        return {"codec": s.codec, **{k: getattr(s, k) for k in _OPTIONS.get(s.codec, ())}}

    # -- which tensors are coded ----------------------------------------------------------------------------
    def declared_exact(self, name: str) -> str | None:
        """The pattern of ``exact`` that ``name`` matches, or ``None``."""
        return next((p for p in self.exact if fnmatch.fnmatchcase(name, p)), None)

    def coded(self, msg: Message) -> list[str]:
        """The tensors of ``msg`` the lossy stage codes, sorted: floating, finite, not declared exact (those it
        meets are noted in :attr:`exact_seen`)."""
        out = []
        for name, t in sorted(msg.tensors().items()):
            if not t.is_floating_point():
                continue
            pattern = self.declared_exact(name)
            if pattern is not None:
                self.exact_seen.setdefault(pattern, name)
            elif bool(torch.isfinite(t).all()):
                out.append(name)
        return out

    def exact_line(self) -> str | None:
        """One line naming the patterns of exact tensors met since the last line (``None``: none new)."""
        new = {p: n for p, n in self.exact_seen.items() if p not in self._said}
        if not new or not self.section.codec:
            return None
        self._said |= set(new)
        listed = ", ".join(f"{p} (e.g. {n})" for p, n in sorted(new.items()))
        return (f"{self.direction}.codec = {self.section.codec!r} leaves the tensors the method declares exact as they "
                f"are: {listed}; integer tensors and scalars always travel exactly")

    # -- encoding -------------------------------------------------------------------------------------------
    def encode(self, msg: Message, reference: Message | None, client: int, rnd: int,
               residual: Mapping[str, torch.Tensor] | None = None) -> tuple[Message, dict[str, torch.Tensor]]:
        """``(coded message, new residuals)`` of ``msg`` for ``client`` in round ``rnd``; ``reference``: what the
        receiver holds that updates are measured from (the broadcast, for a reply; ``None``); ``residual``: the
        residuals to add (error feedback; ``None`` = off, and no residuals come back)."""
        if not self.active:
            return msg, {}
        t0, s = time.perf_counter(), self.section
        out, new = self._lossy(msg, reference, client, rnd, residual) if s.codec else (Message(msg), {})
        if s.lossless != "none":
            raw = compress(out.to_bytes(), s.lossless, s.lossless_level)
            out = Message({f"@{s.lossless}": torch.frombuffer(bytearray(raw), dtype=torch.uint8)})
        self.seconds += time.perf_counter() - t0
        return out, new

    def coded_size(self, msg: Message, reference: Message | None) -> int:
        """The bytes ``msg`` travels in, coded by the lossy stage only (a method's own protocol messages,
        :meth:`~fedlowrank.methods.base.Method.protocol_messages`, whose values the runtime does not see: the
        lossless stage's size would depend on them)."""
        if not self.section.codec:
            return msg.nbytes()
        return self._lossy(msg, reference, 0, 0, None)[0].nbytes()

    def _lossy(self, msg: Message, reference: Message | None, client: int, rnd: int,
               residual: Mapping[str, torch.Tensor] | None) -> tuple[Message, dict[str, torch.Tensor]]:
        s = self.section
        names = self.coded(msg)
        out = Message({k: v for k, v in msg.items() if k not in names})
        gen = torch_generator(self.seed, f"{self.direction}-codec", client, rnd) \
            if s.codec in QUANTIZED and s.rounding == "stochastic" else None
        parts: dict[str, list[torch.Tensor]] = {}
        entries, new = [], {}
        for name in names:
            t = msg[name]
            base = self._base(reference, name, t.shape, t.dtype)
            u = t.to(torch.float64).reshape(-1) - base
            if residual is not None and name in residual and residual[name].shape == t.shape:
                u = u + residual[name].to(torch.float64).reshape(-1)
            coded, decoded = self._code(u, gen)
            for p, v in coded.items():
                parts.setdefault(p, []).append(v)
            entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
            if residual is not None:  # what the receiver's tensor will hold, in its dtype, minus the reference
                sent = (base + decoded).to(t.dtype).to(torch.float64) - base
                new[name] = (u - sent).reshape(t.shape).to(t.dtype)
        out.update({PART + p: torch.cat(v) for p, v in parts.items()})
        out[HEADER] = {**self.options(), "entries": entries}
        return out, new

    @staticmethod
    def _base(reference: Message | None, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """What tensor ``name`` is coded relative to: its reference (flat, float64), or zeros."""
        ref = reference_of(reference, name, shape, dtype) if reference is not None else None
        return ref.to(torch.float64).reshape(-1) if ref is not None else torch.zeros(math.prod(shape), dtype=torch.float64)

    def _code(self, u: torch.Tensor, gen: torch.Generator | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``(parts, decoded)`` of the flat update ``u [n]`` (float64): its coded parts (:meth:`part_lengths`), and
        what they decode to."""
        s = self.section
        if s.codec in ("fp16", "bf16"):
            v = u.to(_VALUES[s.codec])
            return {"v": v}, v.to(torch.float64)
        if s.codec in QUANTIZED:
            levels = self.levels()
            codes, scales = quantize_blocks(u, s.block, levels, gen)
            return ({"q": pack_codes(codes, BITS[s.codec]), "s": scales},
                    dequantize_blocks(codes, scales, s.block, levels))
        k = topk_count(u.numel(), s.topk_fraction, s.topk_count)
        indices, values = top_k(u, k)
        values = values.to(_VALUES[s.values])
        decoded = torch.zeros_like(u)
        decoded[indices] = values.to(torch.float64)
        return {"v": values, "i": pack_codes(indices, index_bits(u.numel()))}, decoded

    def part_lengths(self, n: int) -> dict[str, tuple[torch.dtype, int]]:
        """The dtype and length of each coded part of a tensor of ``n`` entries (each part of a message is the
        concatenation of its tensors' in the header's order)."""
        s = self.section
        if s.codec in ("fp16", "bf16"):
            return {"v": (_VALUES[s.codec], n)}
        if s.codec in QUANTIZED:
            return {"q": (torch.uint8, packed_length(n, BITS[s.codec])), "s": (torch.bfloat16, -(-n // s.block))}
        k = topk_count(n, s.topk_fraction, s.topk_count)
        return {"v": (_VALUES[s.values], k), "i": (torch.uint8, packed_length(k, index_bits(n)))}

    def levels(self) -> torch.Tensor:
        s = self.section
        return NF4_LEVELS if s.levels == "nf4" else uniform_levels(BITS[s.codec])

    # -- decoding -------------------------------------------------------------------------------------------
    def decode(self, coded: Message, reference: Message | None, limit: int | None = None) -> Message:
        """The message ``coded`` carries; ``reference`` as for :meth:`encode`; ``limit``: the most bytes the decoded
        message may have (``None``: no bound). :class:`~.lossless.CodecError` says what is wrong with a coded message
        that does not decode."""
        if not self.active:
            return coded
        t0 = time.perf_counter()
        try:
            return self._decode(coded, reference, limit)
        finally:
            self.seconds += time.perf_counter() - t0

    def _decode(self, coded: Message, reference: Message | None, limit: int | None) -> Message:
        s, what = self.section, f"{self.direction} coded with {self.describe()!r}"
        msg = coded
        if s.lossless != "none":
            name = f"@{s.lossless}"
            raw = coded.get(name)
            if set(coded) != {name} or not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
                raise CodecError(f"a {what} is one uint8 tensor {name!r}; got entries {sorted(coded)[:4]}")
            inner = decompress(raw.numpy().tobytes(), s.lossless, limit)
            try:
                msg = Message.from_bytes(inner)
            except FormatError as exc:
                raise CodecError(f"the {s.lossless} payload of a {what} is not a message ({exc})") from None
        if not s.codec:
            return msg
        header = msg.get(HEADER)
        if not isinstance(header, dict) or not isinstance(header.get("entries"), list):
            raise CodecError(f"a {what} carries the header {HEADER!r} with its entries; got {header!r:.80}")
        options = {k: v for k, v in header.items() if k != "entries"}
        if options != self.options():
            raise CodecError(f"the header says {options}, but this link codes with {self.options()}")
        out = Message({k: v for k, v in msg.items() if not k.startswith(PART)})
        entries = [self._entry(entry, out) for entry in header["entries"]]
        if len({name for name, *_ in entries}) != len(entries):
            raise CodecError("the header names a tensor twice")
        size = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in entries)
        if limit is not None and size > limit:
            raise CodecError(f"the coded tensors decode to {size} bytes, more than the bound of {limit} bytes")
        lengths = [self.part_lengths(math.prod(shape)) for _, _, shape in entries]
        parts = {}
        for p, (dtype, _) in (lengths[0] if lengths else {}).items():
            t, total = msg.get(PART + p), sum(ln[p][1] for ln in lengths)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() != total:
                have = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
                raise CodecError(f"coded part {PART + p!r} must be {dtype} [{total}], got {have}")
            parts[p] = t.split([ln[p][1] for ln in lengths])
        stray = sorted(k for k in msg.tensors() if k.startswith(PART) and k[len(PART):] not in parts)
        if stray:
            raise CodecError(f"tensor {stray[0]!r} is no part of a {what} with these entries")
        for i, (name, dtype, shape) in enumerate(entries):
            decoded = self._decode_parts(name, {p: chunks[i] for p, chunks in parts.items()}, math.prod(shape))
            out[name] = (self._base(reference, name, shape, dtype) + decoded).reshape(shape).to(dtype)
        for name, t in out.tensors().items():  # what was sent exactly
            pattern = self.declared_exact(name) if t.is_floating_point() else None
            if pattern is not None and not any(name == e[0] for e in entries):
                self.exact_seen.setdefault(pattern, name)
        return out

    @staticmethod
    def _entry(entry: Any, plain: Message) -> tuple[str, torch.dtype, list[int]]:
        """``(name, dtype, shape)`` of a header entry ``[name, dtype, shape]`` that names no tensor of ``plain``."""
        ok = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in _FLOATS
              and isinstance(entry[2], list)
              and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in entry[2]))
        if not ok:
            raise CodecError(f"a header entry must be [name, a floating dtype, a shape], got {entry!r:.80}")
        if entry[0] in plain or entry[0].startswith(PART):
            raise CodecError(f"header entry {entry[0]!r} is also sent uncoded, or names a coded part")
        return entry[0], _FLOATS[entry[1]], entry[2]

    def _decode_parts(self, name: str, got: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """The flat decoded update [n] (float64) of tensor ``name`` from its chunks of the coded parts."""
        s = self.section
        if s.codec in ("fp16", "bf16"):
            return got["v"].to(torch.float64)
        if s.codec in QUANTIZED:
            bits, levels, scales = BITS[s.codec], self.levels(), got["s"]
            codes = unpack_codes(got["q"], n, bits)
            if n and int(codes.max()) >= len(levels):
                raise CodecError(f"tensor {name!r}: code {int(codes.max())} is beyond the {len(levels)} levels")
            if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
                raise CodecError(f"tensor {name!r}: a block scale is negative or not finite")
            return dequantize_blocks(codes, scales, s.block, levels)
        k = got["v"].numel()
        indices = unpack_codes(got["i"], k, index_bits(n))
        if k and (int(indices[-1]) >= n or not bool((indices[1:] > indices[:-1]).all())):
            raise CodecError(f"tensor {name!r}: top-k indices must increase and stay below {n}")
        out = torch.zeros(n, dtype=torch.float64)
        out[indices] = got["v"].to(torch.float64)
        return out

    # -- a client's reply -----------------------------------------------------------------------------------
    def encode_reply(self, reply: Message, down: Message, state: State, residual: Mapping[str, torch.Tensor],
                     client: int, rnd: int) -> tuple[Message, State]:
        """A client's ``reply`` to ``down`` coded, and its new ``state`` (the method's) with error feedback's new
        residuals (``residual``: the old ones, :func:`split_state`)."""
        coded, new = self.encode(reply, down, client, rnd, residual if self.error_feedback else None)
        if not self.error_feedback:
            return coded, state
        out = State(state)
        out.update({RESIDUAL + k: v for k, v in new.items()})
        return coded, out
