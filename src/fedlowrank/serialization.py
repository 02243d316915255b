"""Tensor containers and their byte format.

One format serves messages, states and checkpoints: safetensors (8-byte little-endian header length, a JSON header,
raw little-endian tensor bytes), written and parsed by the ``safetensors`` library. Scalars and small lists ride in
the header's ``__metadata__`` as one JSON text (key ``"json"``) in which every number and boolean has a fixed width
(:func:`encode_scalars`): a container's size depends on its names, dtypes, shapes and strings, never on its numeric
values, so the communication ledger counts the same bytes for the same payload whatever the losses and metrics in it.

Reading never unpickles anything, and any bytes either parse to a valid container (tensors of the dtypes below,
boolean tensors of 0/1 bytes, scalars in a JSON object, no name both a tensor and a scalar) or raise
:class:`FormatError`.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, Mapping

import numpy as np
import torch
from safetensors import SafetensorError, TensorSpec, deserialize, serialize

Scalar = int | float | str | bool | None | list | dict

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_OF = {v: k for k, v in _DTYPES.items()}
# The order in which the library lays tensors out (largest alignment first, then by name): their data offsets, and
# so the header's length, follow it.
_LAYOUT_RANK = {code: i for i, code in enumerate(("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"))}
_META_KEY, _SCALARS_KEY = "__metadata__", "json"
_INT_WIDTH, _FLOAT_WIDTH = 20, 24  # int64 ("-9223372036854775808"); a float64's repr ("-2.2250738585072014e-308")


class FormatError(ValueError):
    """Raised when bytes are not a valid tensor container (truncated, corrupted, unknown dtype...)."""


class TensorDict(dict):
    """A flat mapping of names to tensors and small JSON-able scalars.

    Base of :class:`fedlowrank.message.Message` and :class:`fedlowrank.message.State`. Its serialised size,
    ``nbytes()``, equals ``len(to_bytes())`` exactly, is what the communication ledger counts, and does not depend
    on the values of its tensors or numeric scalars.
    """

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.items() if isinstance(v, torch.Tensor)}

    def scalars(self) -> dict[str, Scalar]:
        return {k: v for k, v in self.items() if not isinstance(v, torch.Tensor)}

    def to_bytes(self) -> bytes:
        return dumps(self.tensors(), self.scalars())

    def nbytes(self) -> int:
        tensors, scalars = self.tensors(), self.scalars()
        header = _header(tensors, encode_scalars(scalars) if scalars else None)
        return 8 + len(header) + sum(t.numel() * t.element_size() for t in tensors.values())

    def state_dict(self) -> dict[str, Any]:
        return dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clear()
        self.update(state)

    @classmethod
    def from_bytes(cls, data: bytes):
        tensors, scalars = loads(data)
        out = cls()
        out.update(scalars)
        out.update(tensors)
        return out


# -- scalars: JSON with fixed-width numbers ---------------------------------------------------------------------
def _key(key: Any, name: str) -> str:
    """A dict key as JSON writes it (``1`` → ``"1"``, ``True`` → ``"true"``)."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    raise TypeError(f"value of {name!r}: dict key {key!r} is not a string or number")


def _encode(value: Any, name: str) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true " if value else "false"
    if isinstance(value, int):
        return int.__repr__(value).rjust(_INT_WIDTH)
    if isinstance(value, float):
        return json.dumps(float(value)).rjust(_FLOAT_WIDTH)  # NaN and ±Infinity as JSON (allow_nan) writes them
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_encode(v, name) for v in value) + "]"
    if isinstance(value, dict):
        return _encode_object(value, lambda key: name)
    raise TypeError(f"value of {name!r} must be a tensor or a JSON scalar/list, got {type(value).__name__}")


def _encode_object(value: Mapping, name) -> str:
    """``{...}`` with sorted keys; ``name(key)`` is what errors call the value."""
    items = sorted((_key(k, name(k)), k) for k in value)
    return "{" + ",".join(f"{json.dumps(text)}:{_encode(value[k], name(k))}" for text, k in items) + "}"


def encode_scalars(scalars: Mapping[str, Scalar]) -> str:
    """JSON text of ``scalars`` (keys sorted) whose length does not depend on the numbers in it: every integer is
    right-aligned in 20 characters (the width of any int64), every float in 24 (its shortest round-trip repr, or
    ``NaN``/``Infinity``), every boolean in 5. Lists, dicts, strings and ``None`` as JSON writes them."""
    return _encode_object(scalars, str)


# -- bytes ------------------------------------------------------------------------------------------------------
def _code(name: str, t: torch.Tensor) -> str:
    """The format's dtype code of tensor ``name``; ``TypeError`` for what the format cannot hold."""
    if name == _META_KEY:
        raise TypeError(f"tensor name {_META_KEY!r} is reserved by the format")
    if t.dtype not in _DTYPES:
        raise TypeError(f"tensor {name!r}: dtype {t.dtype} is not serialisable")
    return _DTYPES[t.dtype]


def _header(tensors: Mapping[str, torch.Tensor], scalars_json: str | None) -> bytes:
    """The JSON header the library writes for ``tensors`` and the scalars' text, padding included."""
    entries: dict[str, Any] = {} if scalars_json is None else {_META_KEY: {_SCALARS_KEY: scalars_json}}
    codes = {name: _code(name, t) for name, t in tensors.items()}
    offset = 0
    for name in sorted(tensors, key=lambda n: (_LAYOUT_RANK[codes[n]], n)):
        t = tensors[name]
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": codes[name], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    return raw + b" " * (-len(raw) % 8)  # the data start is aligned to 8 bytes


def dumps(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Scalar] | None = None) -> bytes:
    """Serialise tensors (+ scalars in the metadata, :func:`encode_scalars`) to safetensors bytes."""
    cpu = {name: t if t.device.type == "cpu" and t.is_contiguous() else t.detach().to("cpu").contiguous()
           for name, t in tensors.items() if _code(name, t)}  # a host tensor is written from its own memory
    specs = {name: TensorSpec(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), data_ptr=t.data_ptr(),
                              data_len=t.numel() * t.element_size()) for name, t in cpu.items()}
    metadata = {_SCALARS_KEY: encode_scalars(scalars)} if scalars else None
    return serialize(specs, metadata=metadata)  # ``cpu`` keeps every buffer alive during the call


def _scalars(header_bytes: bytes) -> dict[str, Scalar]:
    """The scalars in a header the library has parsed: ``__metadata__["json"]``, a JSON object, or none."""
    try:
        meta = json.loads(header_bytes).get(_META_KEY) or {}
        text = meta.get(_SCALARS_KEY)
        scalars = {} if text is None else json.loads(text)
    except (ValueError, AttributeError, TypeError, RecursionError) as exc:
        raise FormatError(f"tensor container metadata is malformed: {exc}") from None
    if not isinstance(scalars, dict):
        raise FormatError(f"tensor container scalars must be a JSON object, got {type(scalars).__name__}")
    return scalars


_ALIGNMENT = 64  # bytes: where torch's CPU allocator starts every tensor


@dataclasses.dataclass
class _HostBuffer:
    """One writable host allocation for a container's tensors: ``memory`` (uint8) and each tensor's ``(start, end)``
    in it, every start a multiple of :data:`_ALIGNMENT` from an aligned base (so that vectorised kernels see a parsed
    tensor as they see one torch allocated, and sum in the same order)."""

    memory: np.ndarray
    spans: list[tuple[int, int]]


def _host_buffer(sizes: list[int]) -> _HostBuffer:
    """An aligned :class:`_HostBuffer` for tensors of ``sizes`` bytes, in order."""
    spans, offset = [], 0
    for n in sizes:
        spans.append((offset, offset + n))
        offset += n + (-n % _ALIGNMENT)
    raw = np.empty(offset + _ALIGNMENT, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGNMENT
    return _HostBuffer(raw[skip : skip + offset], spans)


def loads(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Scalar]]:
    """Parse safetensors bytes into ``(tensors, scalars)``, each in the order of their names (what iterates over a
    container, e.g. a sum over modules, then does not depend on the file's layout); raises :class:`FormatError` on
    anything else. The tensors are writable views of one aligned host allocation (:class:`_HostBuffer`): parsing
    dispatches at most one operation per tensor (its shape), whatever their number."""
    data = bytes(data)
    if len(data) < 8:
        raise FormatError(f"tensor container truncated: {len(data)} bytes, need at least 8")
    try:
        entries = deserialize(data)
    except (SafetensorError, ValueError, TypeError, OverflowError, MemoryError) as exc:
        raise FormatError(f"not a valid tensor container: {exc}") from None
    (hlen,) = struct.unpack("<Q", data[:8])
    scalars = _scalars(data[8 : 8 + hlen])
    entries = sorted(entries, key=lambda entry: entry[0])  # by name, whatever order the file has
    for name, info in entries:
        if info["dtype"] not in _TORCH_OF:
            raise FormatError(f"tensor {name!r}: dtype {info['dtype']} is not one of {', '.join(_TORCH_OF)}")
        raw = info["data"]
        if info["dtype"] == "BOOL" and len(raw) and int(np.frombuffer(raw, dtype=np.uint8).max()) > 1:
            raise FormatError(f"tensor {name!r}: a boolean tensor holds bytes other than 0 and 1")
    host = _host_buffer([len(info["data"]) for _, info in entries])
    tensors: dict[str, torch.Tensor] = {}
    for (name, info), (start, end) in zip(entries, host.spans):
        dtype, shape = _TORCH_OF[info["dtype"]], list(info["shape"])
        if start == end:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        host.memory[start:end] = np.frombuffer(info["data"], dtype=np.uint8)
        flat = torch.frombuffer(host.memory[start:end], dtype=dtype)  # a view: no copy, no operation
        tensors[name] = flat if len(shape) == 1 else flat.view(shape)
    both = sorted(set(tensors) & set(scalars))
    if both:
        raise FormatError(f"tensor container names {both[0]!r} both as a tensor and as a scalar")
    return tensors, scalars


__all__ = ["FormatError", "Scalar", "TensorDict", "dumps", "encode_scalars", "loads"]
