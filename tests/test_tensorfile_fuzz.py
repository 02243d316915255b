"""The tensor file format (serialization.py): any bytes parse to a valid container or raise FormatError, never
another exception; the size of a container does not depend on its values and is predicted exactly; the bytes are
the safetensors library's."""

import json
import math
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlowrank.message import Message, State
from fedlowrank.serialization import _DTYPES, FormatError, dumps, encode_scalars, loads

DTYPES = sorted(_DTYPES, key=str)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
SCALARS = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), FLOATS, st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
NAMES = st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__")


@st.composite
def tensors(draw, dtype=None):
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * torch.empty((), dtype=dtype).element_size(),
                         max_size=n * torch.empty((), dtype=dtype).element_size()))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)
    flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.reshape(shape)


@st.composite
def containers(draw):
    names = draw(st.lists(NAMES, unique=True, max_size=5))
    split = draw(st.integers(0, len(names)))
    out = Message({n: draw(tensors()) for n in names[:split]})
    out.update({n: draw(SCALARS) for n in names[split:]})
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (comparing them compares NaNs and signed zeros too)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def same(a, b) -> bool:
    """Equal scalars, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(map(str, a)) == set(b) and all(same(v, b[str(k)]) for k, v in a.items())
    return type(a) is type(b) and a == b


def valid_or_format_error(data: bytes) -> None:
    """The promise: a valid container, or FormatError; never another exception."""
    try:
        tensors, scalars = loads(data)
    except FormatError as exc:
        assert str(exc)
        return
    assert isinstance(scalars, dict) and not set(tensors) & set(scalars)
    json.dumps(scalars)  # plain JSON values only
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor) and t.dtype in _DTYPES and all(s >= 0 for s in t.shape), name
        if t.dtype == torch.bool:
            assert bool((bits(t) <= 1).all())
        t.add_(0) if t.dtype != torch.bool else t.logical_not_()  # owned and writable
    assert Message.from_bytes(dumps(tensors, scalars)).keys() == {*tensors, *scalars}  # and writable again


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(containers())
def test_round_trip_is_exact_and_nbytes_is_the_length(msg):
    data = msg.to_bytes()
    assert msg.nbytes() == len(data)
    back = Message.from_bytes(data)
    assert set(back) == set(msg)
    assert list(back.tensors()) == sorted(msg.tensors())  # by name, not in the library's layout order
    for k, v in msg.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and back[k].shape == v.shape
            assert bits(back[k]).equal(bits(v))  # bit for bit, NaN included
        else:
            assert same(v, back[k]), k


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(containers(), st.data())
def test_size_does_not_depend_on_numeric_values(msg, data):
    """Same names, shapes and strings, other numbers (a loss printed with one more digit, a count of another
    width, a NaN): the same size."""
    def renumber(value):
        if isinstance(value, bool):
            return data.draw(st.booleans())
        if isinstance(value, int):
            return data.draw(st.integers(-2**63, 2**63 - 1))
        if isinstance(value, float):
            return data.draw(FLOATS)
        if isinstance(value, list):
            return [renumber(v) for v in value]
        if isinstance(value, dict):
            return {k: renumber(v) for k, v in value.items()}
        return value

    other = Message({k: torch.rand(v.shape).to(v.dtype) if isinstance(v, torch.Tensor) else renumber(v)
                     for k, v in msg.items()})
    assert other.nbytes() == msg.nbytes() == len(other.to_bytes())


def test_a_reply_counts_the_same_bytes_whatever_its_loss():
    a = Message({"A": torch.ones(2, 8), "num_examples": 7, "train_loss": 0.5})
    b = Message({"A": torch.zeros(2, 8), "num_examples": 1234567, "train_loss": 1.2345678901234567e-300})
    c = Message({"A": torch.zeros(2, 8), "num_examples": -3, "train_loss": float("nan")})
    assert a.nbytes() == b.nbytes() == c.nbytes() == len(a.to_bytes()) == len(b.to_bytes()) == len(c.to_bytes())
    assert json.loads(encode_scalars({"x": 0.1, "n": 3, "f": False})) == {"x": 0.1, "n": 3, "f": False}


@settings(max_examples=60, deadline=None)
@given(containers())
def test_the_bytes_are_the_libraries_both_ways(msg):
    data = msg.to_bytes()
    for name, t in safetensors.torch.load(data).items():
        assert bits(t).equal(bits(msg[name]))
    tensors = msg.tensors()
    assert loads(safetensors.torch.save({k: v.clone() for k, v in tensors.items()}))[0].keys() == tensors.keys()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes(data):
    valid_or_format_error(data)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(containers(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255), st.sampled_from(
    ["set", "insert", "delete", "truncate"])), min_size=1, max_size=4))
def test_mutated_valid_files(msg, edits):
    data = bytearray(msg.to_bytes())
    for pos, byte, how in edits:
        pos %= len(data) + 1
        if how == "set" and pos < len(data):
            data[pos] = byte
        elif how == "insert":
            data[pos:pos] = bytes([byte])
        elif how == "delete":
            del data[pos:pos + 1]
        else:
            del data[pos:]
    valid_or_format_error(bytes(data))


JSON_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                     st.text(max_size=5)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=5)
ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(["F32", "F64", "I64", "BOOL", "BF16", "U8", "F8_E4M3", "C64", "U64", "f32", ""]),
                       JSON_VALUES),
    "shape": st.one_of(st.lists(st.integers(-2, 5), max_size=3), st.lists(st.floats(-1, 5), max_size=2), JSON_VALUES),
    "data_offsets": st.one_of(st.lists(st.integers(-8, 64), min_size=0, max_size=3), JSON_VALUES),
})
METADATA = st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(["json", "format", "x"]), st.one_of(
    st.text(max_size=10), st.just('{"a": 1}'), st.just("[1, 2]"), st.just('{"t": 1}'), st.just("{"), JSON_VALUES),
    max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.one_of(st.sampled_from(["t", "a", "__metadata__"]), st.text(max_size=4)),
                       st.one_of(ENTRY, JSON_VALUES), max_size=3),
       METADATA, st.integers(0, 64), st.integers(-3, 3), st.booleans())
def test_crafted_headers(entries, metadata, body, length_error, with_metadata):
    if with_metadata:
        entries = {**entries, "__metadata__": metadata}
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    valid_or_format_error(struct.pack("<Q", max(0, len(header) + length_error)) + header + bytes(range(body)))


@pytest.mark.parametrize("shape, offsets", [([-1], [0, 4]), ([1.0], [0, 4]), (["1"], [0, 4]), ([2], [0, 4]),
                                            ([1], [4, 0]), ([1], [0, 4, 8]), ([2**62, 2**62], [0, 4]), (None, [0, 4])])
def test_impossible_shapes_and_offsets_are_format_errors(shape, offsets):
    header = json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}).encode()
    with pytest.raises(FormatError):
        loads(struct.pack("<Q", len(header)) + header + b"\0" * 8)


@pytest.mark.parametrize("metadata", [{"json": "[1]"}, {"json": "{"}, {"json": '{"t": 1}'}, {"json": "7"}])
def test_malformed_scalars_are_format_errors(metadata):
    data = safetensors.torch.save({"t": torch.ones(1)}, metadata=metadata)
    with pytest.raises(FormatError):
        loads(data)


def test_unsupported_dtypes_and_non_boolean_bytes_are_format_errors():
    with pytest.raises(FormatError, match="dtype"):
        loads(safetensors.torch.save({"c": torch.ones(2, dtype=torch.complex64)}))
    data = bytearray(State({"b": torch.ones(3, dtype=torch.bool)}).to_bytes())
    data[-1] = 2
    with pytest.raises(FormatError, match="boolean"):
        loads(bytes(data))


def test_what_the_format_cannot_hold_is_refused_when_writing():
    for bad in ({"__metadata__": torch.ones(1)}, {"c": torch.ones(1, dtype=torch.complex64)}):
        with pytest.raises(TypeError):
            Message(bad).to_bytes()
        with pytest.raises(TypeError):
            Message(bad).nbytes()
    with pytest.raises(TypeError, match="'x'"):
        Message({"x": object()}).to_bytes()


def test_shared_and_strided_tensors_are_written_as_their_values():
    base = torch.arange(12.0).reshape(3, 4)
    msg = Message({"all": base, "col": base[:, 1], "row": base[1], "t": base.T})
    back = Message.from_bytes(msg.to_bytes())
    assert msg.nbytes() == len(msg.to_bytes())
    for k, v in msg.items():
        assert torch.equal(back[k], v)
