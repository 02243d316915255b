import pytest
import torch

from fedlowrank.message import Message, State
from fedlowrank.serialization import FormatError, dumps, loads


def _msg():
    g = torch.Generator().manual_seed(0)
    return Message({"a.lora_A": torch.randn(3, 5, generator=g), "b": torch.arange(4, dtype=torch.int64),
                    "h": torch.randn(2, generator=g).to(torch.bfloat16), "num_examples": 7, "train_loss": 0.25,
                    "tag": "x", "ranks": [1, 2]})


def test_round_trip_and_size():
    msg = _msg()
    data = msg.to_bytes()
    assert msg.nbytes() == len(data)
    back = Message.from_bytes(data)
    assert set(back) == set(msg)
    for k, v in msg.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v)
        else:
            assert back[k] == v


def test_readable_by_the_safetensors_library():
    safetensors_torch = pytest.importorskip("safetensors.torch")
    msg = _msg()
    loaded = safetensors_torch.load(msg.to_bytes())
    assert torch.equal(loaded["a.lora_A"], msg["a.lora_A"]) and torch.equal(loaded["h"], msg["h"])
    # and the other way round: bytes written by the library parse here
    tensors, scalars = loads(safetensors_torch.save({"x": torch.ones(2, 2)}))
    assert torch.equal(tensors["x"], torch.ones(2, 2)) and scalars == {}


@pytest.mark.parametrize("cut", [0, 5, 12, -3])
def test_truncated_bytes_are_refused(cut):
    data = _msg().to_bytes()
    with pytest.raises(FormatError):
        loads(data[:cut])


def test_corrupted_header_is_refused():
    data = bytearray(_msg().to_bytes())
    data[10] = ord("{") if data[10] != ord("{") else ord("[")
    data[9] = 0xFF
    with pytest.raises(FormatError):
        loads(bytes(data))


def test_state_dict_round_trip():
    s = State({"x": torch.ones(3), "step": 4})
    t = State()
    t.load_state_dict(s.state_dict())
    assert torch.equal(t["x"], s["x"]) and t["step"] == 4
    assert dumps({}, {}) and loads(dumps({}, {"k": 1})) == ({}, {"k": 1})
