"""Property tests: malformed config input and malformed replies end in a clear error or a rejection, never a crash."""

import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlowrank.config import ConfigError, from_dict, load_config, parse_override
from fedlowrank.message import Message
from fedlowrank.runtime.engine import check_reply
from fedlowrank.serialization import FormatError, loads

from helpers import tiny_simulation

KEYS = ["run.rounds", "run.clients_per_round", "run.seed", "lora.rank", "lora.alpha", "lora.ranks", "lora.scaling",
        "train.lr", "train.optimizer", "train.batch_size", "partition.kind", "partition.alpha", "method.name",
        "method.correction", "server.weighting", "data.source", "task.max_length", "bogus.key", "run.bogus", "x"]
VALUES = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True), st.text(max_size=12), st.booleans(),
                   st.lists(st.integers(-3, 40), max_size=4), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.text(max_size=20)), max_size=4))
def test_overrides_never_crash(pairs):
    try:
        load_config("tiny", [f"{k}={v}" for k, v in pairs])
    except ConfigError as exc:
        assert str(exc)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["run", "lora", "train", "partition", "method", "server", "zzz"]),
                       st.dictionaries(st.sampled_from(["rounds", "rank", "lr", "alpha", "name", "kind", "ranks",
                                                        "weighting", "optimizer", "seed", "y"]), VALUES, max_size=3),
                       max_size=3))
def test_config_tables_never_crash(raw):
    try:
        from_dict(raw)
    except ConfigError as exc:
        assert str(exc)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=30))
def test_override_parser_never_crashes(text):
    try:
        parse_override(text)
    except ConfigError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_byte_parser_never_crashes_on_garbage(data):
    try:
        loads(data)
    except FormatError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.integers(0, 64), max_size=3), st.integers(0, 500))
def test_byte_parser_refuses_lying_headers(shapes, extra):
    import json

    header = json.dumps({k: {"dtype": "F32", "shape": [v], "data_offsets": [0, 4 * v + extra]}
                         for k, v in shapes.items()}).encode()
    try:
        loads(struct.pack("<Q", len(header)) + header + b"\0" * (extra % 7))
    except FormatError:
        pass


_SIM = []


def _sim():
    if not _SIM:
        _SIM.append(tiny_simulation("fedit"))
    return _SIM[0]


TENSORS = st.one_of(
    st.builds(lambda n, m: torch.randn(n, m), st.integers(0, 5), st.integers(0, 40)),
    st.builds(lambda n: torch.full((n,), float("nan")), st.integers(1, 4)),
    st.builds(lambda n: torch.zeros(n, dtype=torch.int64), st.integers(0, 4)),
    st.builds(lambda n: torch.ones(n, dtype=torch.float16), st.integers(0, 4)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_reply_validator_never_crashes_and_rejects_what_is_off(data):
    sim = _sim()
    down = sim.method.broadcast(sim.server, 0, 1)
    reply = Message({k: v.clone() for k, v in down.tensors().items()})
    reply.update(num_examples=5, train_loss=0.5)
    keys = list(reply.tensors())
    for _ in range(data.draw(st.integers(0, 3))):
        action = data.draw(st.sampled_from(["drop", "replace", "add", "scalar"]))
        if action == "drop" and reply.tensors():
            del reply[data.draw(st.sampled_from(sorted(reply.tensors())))]
        elif action == "replace":
            reply[data.draw(st.sampled_from(keys))] = data.draw(TENSORS)
        elif action == "add":
            reply[data.draw(st.text(min_size=1, max_size=8))] = data.draw(TENSORS)
        else:
            reply[data.draw(st.sampled_from(["num_examples", "train_loss"]))] = data.draw(VALUES)
    reason = check_reply(sim.method, down, reply, 1, client_size=50)
    changed = set(reply.tensors()) != set(keys) or any(
        not isinstance(reply[k], torch.Tensor) or reply[k].shape != down[k].shape or reply[k].dtype != down[k].dtype
        or not torch.equal(reply[k], down[k]) for k in keys if k in reply)
    if reason is None:  # an accepted reply has the right keys, shapes, dtypes and finite values
        assert set(reply.tensors()) == set(keys)
        assert all(reply[k].shape == down[k].shape and reply[k].dtype == down[k].dtype for k in keys)
        assert all(bool(torch.isfinite(reply[k]).all()) for k in keys)
    else:
        assert isinstance(reason, str) and reason
        assert changed or not isinstance(reply["num_examples"], int) or reply["num_examples"] != 5 or \
            reply["train_loss"] != 0.5
