"""Faithful conversion between fedlowrank's flat ``name -> tensor | scalar`` dicts and Flower records.

A :class:`~fedlowrank.message.Message` or :class:`~fedlowrank.message.State` becomes three records:

* ``<prefix>arrays`` — an ``ArrayRecord``, one ``Array`` per tensor, under the same name, in Flower's
  numpy format (so Flower's mods and tools read it); bfloat16, which numpy lacks, travels as raw
  little-endian bytes with ``dtype="bfloat16"`` and ``stype="torch.bfloat16"``;
* ``<prefix>scalars`` — a ``ConfigRecord`` with the ``bool``/``int`` (64-bit)/``float``/``str`` scalars as is;
* ``<prefix>scalars.json`` — a ``ConfigRecord`` with every other scalar (``None``, lists, dicts, big ints)
  as JSON text.

Shapes and keys are free: heterogeneous ranks, stacked factors, control variates and seeds round-trip
unchanged (dtype, shape and values bit for bit).
"""

from __future__ import annotations

import json
from typing import TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from ...serialization import TensorDict

T = TypeVar("T", bound=TensorDict)

ARRAYS, SCALARS, JSON_SCALARS = "arrays", "scalars", "scalars.json"
_BF16_STYPE = "torch.bfloat16"


def _native(value) -> bool:
    if type(value) is int:
        return -(2**63) <= value < 2**63
    return type(value) in (bool, float, str)


def to_array(t: torch.Tensor) -> Array:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return Array(dtype="bfloat16", shape=tuple(t.shape), stype=_BF16_STYPE,
                     data=t.view(torch.int16).numpy().tobytes())
    return Array(t.numpy())


def to_tensor(a: Array) -> torch.Tensor:
    if a.stype == _BF16_STYPE:
        raw = np.frombuffer(a.data, dtype="<i2").copy().reshape(a.shape)
        return torch.from_numpy(raw).view(torch.bfloat16)
    return torch.from_numpy(np.array(a.numpy(), copy=True))


def to_records(d: TensorDict, prefix: str = "") -> dict[str, ArrayRecord | ConfigRecord]:
    """The records that carry ``d`` (names prefixed with ``prefix``)."""
    scalars = d.scalars()
    return {
        prefix + ARRAYS: ArrayRecord({k: to_array(t) for k, t in d.tensors().items()}),
        prefix + SCALARS: ConfigRecord({k: v for k, v in scalars.items() if _native(v)}),
        prefix + JSON_SCALARS: ConfigRecord({k: json.dumps(v) for k, v in scalars.items() if not _native(v)}),
    }


def from_records(content: RecordDict, cls: type[T], prefix: str = "") -> T | None:
    """The dict carried by ``content`` under ``prefix`` (``None`` when it holds none)."""
    if prefix + ARRAYS not in content:
        return None
    out = cls()
    out.update(content.get(prefix + SCALARS, ConfigRecord()))
    out.update({k: json.loads(v) for k, v in content.get(prefix + JSON_SCALARS, ConfigRecord()).items()})
    out.update({k: to_tensor(a) for k, a in content[prefix + ARRAYS].items()})
    return out


def put_records(content: RecordDict, d: TensorDict, prefix: str = "") -> None:
    """Store ``d`` into ``content`` (e.g. ``context.state``), replacing what was there under ``prefix``."""
    for name, record in to_records(d, prefix).items():
        content[name] = record


def records_nbytes(content: RecordDict) -> int:
    """Bytes of the arrays and config values in ``content`` as Flower counts them (payload, no framing): an
    array's data, 1 per bool, 8 per int or float, a string's or bytes' length, each key's length. Config records
    are counted here because Flower 1.41's ``ConfigRecord.count_bytes`` refuses an empty string (SecAgg+'s
    replies carry one)."""
    return sum(_config_nbytes(r) if isinstance(r, ConfigRecord) else r.count_bytes() for r in content.values())


def _config_nbytes(record: ConfigRecord) -> int:
    def size(v) -> int:
        return 1 if isinstance(v, bool) else len(v) if isinstance(v, (str, bytes)) else 8

    return sum(len(k) + (sum(map(size, v)) if isinstance(v, list) else size(v)) for k, v in record.items())
