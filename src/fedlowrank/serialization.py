"""Tensor containers and their byte format.

One format serves messages, states and checkpoints: the safetensors layout (8-byte little-endian header
length, a JSON header, raw little-endian tensor bytes), written with numpy only so that the core needs no
extra dependency. Scalars and small lists ride in the header's ``__metadata__`` as JSON. Nothing is ever
unpickled: reading a file only parses JSON and copies raw bytes.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Mapping

import numpy as np
import torch

Scalar = int | float | str | bool | None | list | dict

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_OF = {v: k for k, v in _DTYPES.items()}
_META_KEY = "__metadata__"


class FormatError(ValueError):
    """Raised when bytes are not a valid tensor container (truncated, corrupted, unknown dtype...)."""


class TensorDict(dict):
    """A flat mapping of names to tensors and small JSON-able scalars.

    Base of :class:`fedlowrank.message.Message` and :class:`fedlowrank.state.State`. Its serialised size,
    ``nbytes()``, equals ``len(to_bytes())`` exactly and is what the communication ledger counts.
    """

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.items() if isinstance(v, torch.Tensor)}

    def scalars(self) -> dict[str, Scalar]:
        return {k: v for k, v in self.items() if not isinstance(v, torch.Tensor)}

    def to_bytes(self) -> bytes:
        return dumps(self.tensors(), self.scalars())

    def nbytes(self) -> int:
        header = _header(self.tensors(), self.scalars())
        return 8 + len(header) + sum(t.numel() * t.element_size() for t in self.tensors().values())

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


def _check_scalar(name: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        return  # NaN/inf scalars are encoded as strings by json (allow_nan) and reported by validators
    try:
        json.dumps(value)
    except TypeError as exc:
        raise TypeError(f"value of {name!r} must be a tensor or a JSON scalar/list, got {type(value).__name__}") from exc


def _header(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Scalar]) -> bytes:
    entries: dict[str, Any] = {}
    if scalars:
        for k, v in scalars.items():
            _check_scalar(k, v)
        entries[_META_KEY] = {"json": json.dumps(dict(scalars), sort_keys=True)}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} is not serialisable")
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes


def dumps(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Scalar] | None = None) -> bytes:
    """Serialise tensors (+ scalars in the metadata) to safetensors bytes."""
    header = _header(tensors, scalars or {})
    parts: list[bytes] = [struct.pack("<Q", len(header)), header]
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            parts.append(t.view(torch.int16).numpy().tobytes())
        else:
            parts.append(t.numpy().tobytes())
    return b"".join(parts)


def loads(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Scalar]]:
    """Parse safetensors bytes; raises :class:`FormatError` on anything malformed."""
    if len(data) < 8:
        raise FormatError(f"tensor container truncated: {len(data)} bytes, need at least 8")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > len(data) - 8:
        raise FormatError(f"tensor container truncated: header of {hlen} bytes, only {len(data) - 8} present")
    try:
        header = json.loads(data[8 : 8 + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"tensor container header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise FormatError("tensor container header must be a JSON object")
    body = memoryview(data)[8 + hlen :]
    scalars: dict[str, Scalar] = {}
    meta = header.pop(_META_KEY, None)
    if meta and "json" in meta:
        scalars = json.loads(meta["json"])
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        try:
            dtype = _TORCH_OF[spec["dtype"]]
            shape = [int(s) for s in spec["shape"]]
            start, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"tensor {name!r}: malformed header entry {spec!r}") from exc
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end > len(body) or start < 0 or end - start != math.prod(shape) * itemsize:
            raise FormatError(f"tensor {name!r}: data offsets {start}..{end} do not fit the shape {shape} or the file")
        np_dtype = np.int16 if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype
        arr = np.frombuffer(body[start:end], dtype=np_dtype).reshape(shape).copy()
        t = torch.from_numpy(arr)
        tensors[name] = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
    return tensors, scalars

