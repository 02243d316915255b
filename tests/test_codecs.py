"""The codecs between a method's messages and the wire (src/fedlowrank/codecs/, docs/codecs.md): each kernel's error
bound, the message-level round trip (exact entries untouched), malformed coded payloads refused with a reason,
error feedback's sum, the ledger's bytes, resume with residuals, the config's one-line errors, DP and SecAgg+."""

from __future__ import annotations

import math

import pytest
import torch

from fedlowrank.cli import main
from fedlowrank.codecs import CodecError, DownlinkSection, Link, UplinkSection
from fedlowrank.codecs.kernels import (NF4_LEVELS, block_scales, dequantize_blocks, index_bits, pack_codes,
                                       quantize_blocks, top_k, uniform_levels, unpack_codes)
from fedlowrank.codecs.lossless import compress, decompress
from fedlowrank.config import ConfigError
from fedlowrank.message import Message
from fedlowrank.methods import available_methods
from fedlowrank.runtime.simulator import Simulation

from helpers import run_tiny, tiny_config, tiny_task


def _x(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.rand(n, generator=g, dtype=torch.float64) ** 4
    x[5:5 + 64] = 0.0  # a block of zeros
    return x


def _gaps(levels: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gap between the two levels around each ``y`` in [-1, 1]."""
    low = (torch.bucketize(y, levels, right=True) - 1).clamp(0, len(levels) - 2)
    return levels[low + 1] - levels[low]


# -- kernels ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("levels", [uniform_levels(8), uniform_levels(4), NF4_LEVELS], ids=["int8", "int4", "nf4"])
@pytest.mark.parametrize("block", [64, 7])
def test_blockwise_absmax_errs_by_at_most_half_a_level_per_entry(levels, block):
    x = _x(1000)
    codes, scales = quantize_blocks(x, block, levels)
    assert scales.dtype == torch.bfloat16 and len(scales) == math.ceil(1000 / block)
    absmax = torch.zeros(len(scales) * block, dtype=torch.float64)
    absmax[:1000] = x.abs()
    assert bool((scales.double() >= absmax.view(-1, block).amax(1)).all())  # rounded up: every entry within its scale
    s = scales.double().repeat_interleave(block)[:1000]
    err = (dequantize_blocks(codes, scales, block, levels) - x).abs()
    half = 0.5 * s * _gaps(levels, torch.where(s > 0, x / s.clamp_min(1e-300), 0.0))
    assert bool((err <= half * (1 + 1e-12) + 1e-300).all())
    assert float(err[5:5 + 64].abs().max()) == 0.0 and int(codes.max()) < len(levels)
    if len(levels) == 15:  # uniform 4-bit: the half level is s/14
        assert float((err - s / 14).max()) <= 1e-15


@pytest.mark.parametrize("levels", [uniform_levels(4), NF4_LEVELS], ids=["int4", "nf4"])
def test_stochastic_rounding_is_unbiased_and_within_one_level(levels):
    x = _x(256, seed=1)
    draws = torch.stack([dequantize_blocks(*quantize_blocks(x, 32, levels, torch.Generator().manual_seed(i)), 32,
                                           levels) for i in range(2000)])
    s = block_scales(x, 32).double().repeat_interleave(32)[:256]
    gap = s * _gaps(levels, torch.where(s > 0, x / s.clamp_min(1e-300), 0.0))
    assert bool(((draws - x).abs() <= gap * (1 + 1e-12)).all())
    # the mean of 2000 draws of a two-point variable of spread `gap` errs by at most 5 standard errors
    assert bool(((draws.mean(0) - x).abs() <= 5 * 0.5 * gap / math.sqrt(2000) + 1e-15).all())
    nearest = dequantize_blocks(*quantize_blocks(x, 32, levels), 32, levels)
    assert float((nearest - x).abs().mean()) > float((draws.mean(0) - x).abs().mean())  # nearest rounding is biased


@pytest.mark.parametrize("bits", [1, 3, 4, 8, 13, 17])
def test_packed_codes_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (101,), generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(101 * bits / 8)
    assert torch.equal(unpack_codes(packed, 101, bits), codes)


def test_top_k_keeps_the_largest_magnitudes_ties_to_the_lower_index():
    x = torch.tensor([0.5, -3.0, 1.0, 3.0, -1.0, 0.0], dtype=torch.float64)
    indices, values = top_k(x, 3)
    assert indices.tolist() == [1, 2, 3] and values.tolist() == [-3.0, 1.0, 3.0]
    assert index_bits(1) == 1 and index_bits(2) == 1 and index_bits(1024) == 10 and index_bits(1025) == 11


@pytest.mark.parametrize("kind", ["zlib", "lzma", "zstd"])
def test_lossless_round_trip_and_its_bound(kind):
    if kind == "zstd":
        pytest.importorskip("zstandard")
    data = b"fedlowrank " * 1000
    packed = compress(data, kind)
    assert len(packed) < len(data) and decompress(packed, kind, len(data)) == data
    with pytest.raises(CodecError, match="more than the bound|within the bound"):
        decompress(packed, kind, len(data) - 1)  # a payload never expands beyond the bound
    for bad in (packed[:-3], packed + b"xx", b"garbage!"):
        with pytest.raises(CodecError):
            decompress(bad, kind, len(data))


# -- a message through a link -----------------------------------------------------------------------------------
def _messages() -> tuple[Message, Message]:
    g = torch.Generator().manual_seed(0)
    down = Message({"m.lora_A": torch.randn(4, 50, generator=g), "m.lora_B": torch.randn(30, 4, generator=g),
                    "sync/m/0": torch.randn(3, 3, generator=g), "round": 2})
    reply = Message({"m.lora_A": down["m.lora_A"] + 0.01 * torch.randn(4, 50, generator=g),
                     "m.lora_B": down["m.lora_B"] + 0.01 * torch.randn(30, 4, generator=g),
                     "sync/m/0": torch.randn(3, 3, generator=g), "fresh": torch.randn(7, 9, generator=g),
                     "ids": torch.arange(5), "mask": torch.tensor([True, False]), "half": torch.randn(6).half(),
                     "num_examples": 40, "train_loss": 0.5, "heads": [1, 3]})
    return down, reply


CODECS = [{"codec": "fp16"}, {"codec": "bf16"}, {"codec": "int8"}, {"codec": "int4"},
          {"codec": "int4", "levels": "nf4", "rounding": "stochastic", "block": 16},
          {"codec": "topk", "topk_fraction": 0.25}, {"codec": "topk", "topk_count": 3, "values": "bf16"},
          {"lossless": "zlib"}, {"codec": "int8", "lossless": "lzma"}, {"codec": "topk", "lossless": "zstd"}]


@pytest.mark.parametrize("options", CODECS, ids=lambda o: "-".join(map(str, o.values())))
def test_a_coded_message_is_a_message_that_decodes_with_exact_entries_untouched(options):
    if options.get("lossless") == "zstd":
        pytest.importorskip("zstandard")
    down, reply = _messages()
    link = Link(UplinkSection(**options), "uplink", exact=("sync/*",))
    coded, _ = link.encode(reply, down, 1, 2)
    data = coded.to_bytes()
    assert coded.nbytes() == len(data)  # what the ledger counts is what is sent
    got = link.decode(Message.from_bytes(data), down, 1 << 20)
    assert sorted(got) == sorted(reply)
    for key in ("ids", "mask", "sync/m/0", "num_examples", "train_loss", "heads"):  # exact: bit for bit
        assert (torch.equal(got[key], reply[key]) and got[key].dtype == reply[key].dtype
                if isinstance(reply[key], torch.Tensor) else got[key] == reply[key]), key
    for key, t in reply.tensors().items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
    if not options.get("codec"):
        assert all(torch.equal(got[k], reply[k]) for k in reply.tensors())
    if options.get("codec") == "int8":  # updates: half a level of each block's largest update entry
        for key in ("m.lora_A", "m.lora_B"):
            delta = (reply[key] - down[key]).double().reshape(-1)
            bound = block_scales(delta, 64).double().repeat_interleave(64)[:delta.numel()] / 127 / 2
            assert bool(((got[key] - reply[key]).double().reshape(-1).abs() <= bound + 1e-6).all()), key
    if options.get("codec") == "topk":  # what top-k drops of an update decodes to the broadcast itself, exactly
        unchanged = got["m.lora_A"] == down["m.lora_A"]
        assert int(unchanged.sum()) >= 200 - (3 if options.get("topk_count") else 50)
    if options.get("codec"):
        line = link.exact_line()  # once
        assert "sync/*" in line and link.exact_line() is None


def test_a_downlink_message_is_coded_as_it_is_and_an_inactive_link_changes_nothing():
    down, _ = _messages()
    coded, _ = Link(DownlinkSection(codec="bf16"), "downlink").encode(down, None, 0, 1)
    got = Link(DownlinkSection(codec="bf16"), "downlink").decode(coded, None)
    assert torch.equal(got["m.lora_A"], down["m.lora_A"].bfloat16().float())
    idle = Link(UplinkSection(), "uplink")
    assert idle.encode(down, None, 0, 1)[0] is down and idle.decode(down, None) is down


def test_stochastic_rounding_is_seeded_by_run_client_and_round():
    down, reply = _messages()
    link = Link(UplinkSection(codec="int4", rounding="stochastic"), "uplink", seed=3)
    first = link.encode(reply, down, 1, 2)[0].to_bytes()
    assert link.encode(reply, down, 1, 2)[0].to_bytes() == first
    assert link.encode(reply, down, 2, 2)[0].to_bytes() != first != link.encode(reply, down, 1, 3)[0].to_bytes()


def test_error_feedback_sends_the_sum_of_the_updates_up_to_the_residual():
    """Over a client's rounds, Σ sent + residual = Σ true updates (each round's update against its own broadcast)."""
    for options in ({"codec": "topk", "topk_fraction": 0.1}, {"codec": "int4", "rounding": "stochastic"}):
        link = Link(UplinkSection(error_feedback=True, **options), "uplink")
        g = torch.Generator().manual_seed(5)
        residual, sent, true = {}, torch.zeros(8, 40, dtype=torch.float64), torch.zeros(8, 40, dtype=torch.float64)
        for rnd in range(1, 7):
            down = Message({"w": torch.randn(8, 40, generator=g)})
            reply = Message({"w": down["w"] + 0.1 * torch.randn(8, 40, generator=g), "num_examples": 1})
            coded, residual = link.encode(reply, down, 0, rnd, residual)
            got = link.decode(coded, down)
            sent += got["w"].double() - down["w"].double()
            true += reply["w"].double() - down["w"].double()
        torch.testing.assert_close(sent + residual["w"].double(), true, rtol=0, atol=1e-5)
        assert float(residual["w"].abs().max()) > 0


def _corrupt(link: Link, coded: Message, how: str) -> Message:
    bad = Message(coded)
    if how == "short part":
        bad["@q"] = bad["@q"][:-1]
    elif how == "wrong dtype":
        bad["@s"] = bad["@s"].float()
    elif how == "missing header":
        del bad["@codec"]
    elif how == "other options":
        bad["@codec"] = {**bad["@codec"], "block": 32}
    elif how == "header entry":
        bad["@codec"] = {**bad["@codec"], "entries": [["m.lora_A", "int64", [4, 50]]]}
    elif how == "stray part":
        bad["@x"] = torch.zeros(3)
    elif how == "code out of range":
        bad["@q"] = torch.full_like(bad["@q"], 0xFF)  # code 15 with 15 uniform levels
    elif how == "negative scale":
        bad["@s"] = -bad["@s"]
    elif how == "entry sent twice":
        bad["m.lora_A"] = torch.zeros(4, 50)
    elif how == "index out of range":
        bad["@i"] = torch.full_like(bad["@i"], 0xFF)
    elif how == "indices not increasing":
        bad["@i"] = torch.zeros_like(bad["@i"])
    return bad


@pytest.mark.parametrize("codec, how, reason", [
    ("int4", "short part", "'@q' must be torch.uint8"), ("int4", "wrong dtype", "'@s' must be torch.bfloat16"),
    ("int4", "missing header", "carries the header"), ("int4", "other options", "the header says"),
    ("int4", "header entry", "floating dtype"), ("int4", "stray part", "'@x' is no part"),
    ("int4", "code out of range", "beyond the 15 levels"), ("int4", "negative scale", "negative or not finite"),
    ("int4", "entry sent twice", "also sent uncoded"),
    ("topk", "index out of range", "indices must increase and stay below"),
    ("topk", "indices not increasing", "indices must increase"),
])
def test_a_malformed_coded_payload_is_refused_with_its_reason(codec, how, reason):
    down, reply = _messages()
    link = Link(UplinkSection(codec=codec, topk_count=5), "uplink") if codec == "topk" else \
        Link(UplinkSection(codec=codec), "uplink")
    coded, _ = link.encode(reply, down, 0, 1)
    with pytest.raises(CodecError, match=reason):
        link.decode(Message.from_bytes(_corrupt(link, coded, how).to_bytes()), down, 1 << 20)


def test_a_coded_payload_beyond_the_bound_or_not_compressed_is_refused():
    down, reply = _messages()
    link = Link(UplinkSection(codec="int8", lossless="zlib"), "uplink")
    coded, _ = link.encode(reply, down, 0, 1)
    with pytest.raises(CodecError, match="bound"):
        link.decode(coded, down, 100)
    with pytest.raises(CodecError, match="one uint8 tensor '@zlib'"):
        link.decode(reply, down, 1 << 20)
    with pytest.raises(CodecError, match="not a message"):
        link.decode(Message({"@zlib": torch.frombuffer(bytearray(compress(b"not a container", "zlib")),
                                                       dtype=torch.uint8)}), down, 1 << 20)


# -- the config --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, names", [
    ("uplink.codec=int9", ("uplink.codec", "int8, int4, topk", "'int9'")),
    ("downlink.codec=topk", ("downlink.codec", "fp16, bf16, int8, int4", "'topk'")),
    ("uplink.block=1", ("uplink.block", "[2,")),
    ("uplink.levels=nf4", ("uplink.levels", "changes nothing", "int8 or int4")),
    ("uplink.topk_fraction=0", ("uplink.topk_fraction", "(0, 1]")),
    ("uplink.error_feedback=true", ("uplink.error_feedback", "needs a lossy uplink.codec")),
    ("downlink.error_feedback=true", ("downlink.error_feedback", "not a config key")),
    ("uplink.lossless=gzip", ("uplink.lossless", "zlib, lzma, zstd")),
    ("uplink.lossless_level=3", ("uplink.lossless_level", "needs a lossless stage")),
])
def test_a_bad_codec_setting_is_one_error_line(setting, names, capsys, tmp_path):
    assert main(["run", "tiny", "--set", setting, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and all(n in err[0] for n in names), err
    assert not (tmp_path / "run").exists()


def test_rules_between_codec_keys_name_them():
    for sets, message in ((["uplink.codec=int8", "uplink.levels=nf4"], "uplink.levels = 'nf4' needs uplink.codec = 'int4'"),
                          (["uplink.codec=int8", "uplink.topk_count=3"], "uplink.topk_count = 3 changes nothing with uplink.codec = 'int8'"),
                          (["uplink.lossless=zlib", "uplink.lossless_level=12"], "uplink.lossless_level must be in [0, 9]"),
                          (["uplink.codec=int8", "run.vectorized=true"], "uplink.codec / uplink.lossless with run.vectorized")):
        with pytest.raises(ConfigError) as err:
            tiny_config(*sets)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_zstd_without_its_package_is_one_line_naming_the_key(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name, *a))
    with pytest.raises(ValueError, match=r"uplink.lossless = 'zstd' needs the zstandard package: pip install"):
        Link(UplinkSection(lossless="zstd"), "uplink")


# -- in a run ----------------------------------------------------------------------------------------------------
CODED = ("uplink.codec=int4", "uplink.rounding=stochastic", "uplink.error_feedback=true", "downlink.codec=int8",
         "run.rounds=3")


def test_the_ledger_counts_the_coded_bytes_sent_and_the_row_names_the_codec():
    sent: dict[tuple[int, int], int] = {}

    def record(rnd, client, reply):
        sent[rnd, client] = len(reply.to_bytes())
        return reply

    sim = Simulation(tiny_config("method.name=fedit", *CODED), task=tiny_task(), tamper=record)
    sim.run()
    plain = run_tiny("fedit", "run.rounds=3")
    assert {(r["round"], r["client"]): r["up"] for r in sim.ledger.rows} == sent
    assert sim.ledger.total_up < 0.7 * plain.ledger.total_up and sim.ledger.total_down < 0.7 * plain.ledger.total_down
    row = sim.history[-1]
    assert row["codec"]["uplink"] == "int4 uniform b64 stochastic + ef" and row["codec"]["downlink"].startswith("int8")
    assert row["time"]["codec"] > 0 and "codec" not in plain.history[-1] and "codec" not in plain.history[-1]["time"]
    assert all(not r.get("rejected") for r in sim.history)
    for k in row["replied"]:  # each used client keeps a residual per uploaded tensor
        residuals = [key for key in sim.store[k] if key.startswith("uplink.residual/")]
        assert len(residuals) == len([t for t in sim.server if t.endswith(("lora_A", "lora_B")) or t.startswith("head/")])


def test_no_codec_changes_no_byte_and_no_result():
    """The default links pass every message through as it is: the run equals one whose links are forced idle."""
    import fedlowrank.codecs.link as link_module

    ref = run_tiny("fedit", "method.correction=scaffold")
    calls = []
    real = link_module.Link.encode
    try:
        link_module.Link.encode = lambda self, msg, *a, **k: calls.append(self.active) or real(self, msg, *a, **k)
        again = run_tiny("fedit", "method.correction=scaffold")
    finally:
        link_module.Link.encode = real
    assert calls and not any(calls)
    assert again.server.to_bytes() == ref.server.to_bytes() and again.ledger.rows == ref.ledger.rows
    assert all("codec" not in r for r in again.history)


def test_a_tampered_coded_reply_is_rejected_with_its_reason_and_the_run_goes_on():
    def truncate(rnd, client, reply):
        if rnd == 1:
            reply = Message(reply)
            reply["@q"] = reply["@q"][:-1]
        return reply

    sim = Simulation(tiny_config("method.name=fedit", "uplink.codec=int8", "run.rounds=2"), task=tiny_task(),
                     tamper=truncate)
    sim.run()
    rejected = sim.history[0]["rejected"]
    assert len(rejected) == 2 and all("the coded reply does not decode: coded part '@q'" in r["reason"]
                                      for r in rejected)
    assert sim.history[0].get("skipped") and not sim.history[1].get("rejected") and sim.round == 2


def test_a_run_with_a_residual_resumes_bit_for_bit(tmp_path):
    sets = ("method.name=fedit", *CODED, "run.checkpoint_every=1")
    full = Simulation(tiny_config(*sets), task=tiny_task(), run_dir=tmp_path / "run")
    full.run()
    resumed = Simulation.resume(tmp_path / "run", task=tiny_task(), round=2)
    assert any(key.startswith("uplink.residual/") for k in resumed.store for key in resumed.store[k])
    resumed.run()
    assert resumed.server.to_bytes() == full.server.to_bytes() and resumed.ledger.rows == full.ledger.rows
    for k in full.store:
        assert resumed.store[k].to_bytes() == full.store[k].to_bytes(), k


def test_a_residual_of_a_tensor_the_method_does_not_upload_is_refused_in_a_checkpoint():
    sim = Simulation(tiny_config("method.name=fedit", *CODED), task=tiny_task())
    schema = sim.state_schema(0)
    name = next(k for k in sim.server if k.endswith("lora_A"))
    assert schema.problem({f"uplink.residual/{name}": torch.zeros(2, 3)}) is None
    assert "is not one the method keeps" in schema.problem({"uplink.residual/unknown.weight": torch.zeros(2)})
    plain = Simulation(tiny_config("method.name=fedit"), task=tiny_task()).state_schema(0)  # no error feedback
    assert "is not one the method keeps" in plain.problem({f"uplink.residual/{name}": torch.zeros(2, 3)})


def test_exact_entries_stay_exact_in_a_run_and_the_run_says_so_once():
    """SSF adds its ``sync/*`` increments to the copy of the model each client keeps: they travel exactly."""
    lines = []
    sim = Simulation(tiny_config("method.name=ssf", "train.optimizer=sgd", "train.lr=0.05", "run.rounds=3",
                                 "downlink.codec=int8", "uplink.codec=int8"), task=tiny_task(), log=lines.append)
    sent = {}
    real = sim.state.downlink.encode

    def spy(msg, reference, client, rnd, residual=None):
        coded, new = real(msg, reference, client, rnd, residual)
        sent.update({k: (msg[k], coded[k]) for k in msg.tensors() if k.startswith("sync/")})
        return coded, new

    sim.state.downlink.encode = spy
    sim.run()
    assert sent and all(torch.equal(a, b) for a, b in sent.values())
    said = [line for line in lines if "leaves the tensors the method declares exact" in line]
    assert len(said) == 1 and "sync/*" in said[0]


def test_local_dp_noise_comes_before_the_codec(monkeypatch):
    """The codec codes the noised reply (post-processing: the guarantee holds for what is sent)."""
    import fedlowrank.runtime.engine as engine
    from fedlowrank.codecs import Link as LinkClass

    noised, coded = [], []
    real_local, real_encode = engine.local_reply, LinkClass.encode_reply
    monkeypatch.setattr(engine, "local_reply", lambda *a: noised.append(real_local(*a)) or noised[-1])
    monkeypatch.setattr(LinkClass, "encode_reply", lambda self, reply, *a: coded.append(reply) or real_encode(self, reply, *a))
    sim = run_tiny("fedit", "privacy.mode=local", "privacy.clip=0.5", "privacy.noise_multiplier=0.5",
                   "uplink.codec=int8")
    assert len(noised) == len(coded) == 4 and all(a is b for a, b in zip(noised, coded))
    assert all(r["epsilon"] > 0 and not r.get("rejected") for r in sim.history)


def test_central_dp_and_robust_aggregation_run_on_the_decoded_replies():
    sim = run_tiny("fedit", "privacy.mode=central", "privacy.clip=0.5", "privacy.noise_multiplier=0.5",
                   "server.weighting=uniform", "uplink.codec=int8", "uplink.error_feedback=true")
    assert all(r["privacy"]["noise_std"] > 0 and not r.get("rejected") for r in sim.history)
    sim = run_tiny("fedit", "server.aggregate=median", "uplink.codec=topk", "uplink.error_feedback=true")
    assert all(r["robust"]["aggregate"] == "median" for r in sim.history)


def test_secagg_refuses_an_uplink_codec_in_one_line_and_takes_a_downlink_one():
    pytest.importorskip("flwr")
    from fedlowrank.runtime.flower.settings import FlowerSettings, check_secagg

    base = ("method.name=fedit", "server.weighting=uniform")
    check_secagg(tiny_config(*base, "downlink.codec=int8"), FlowerSettings(secagg=True))
    for sets in (["uplink.codec=int8"], ["uplink.lossless=zlib"]):
        with pytest.raises(ConfigError) as err:
            check_secagg(tiny_config(*base, *sets), FlowerSettings(secagg=True))
        text = str(err.value)
        assert text.startswith("flower.secagg with uplink.codec") and "leave [uplink] unset" in text and "\n" not in text


PLAIN_SGD = {"ssf": ("train.optimizer=sgd", "train.lr=0.05"), "fedsub": ("train.optimizer=sgd", "train.lr=0.05")}


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_every_method_runs_coded_and_its_residuals_fit_its_state_schema(name):
    """Stochastic int4 with error feedback up, int8 down: no reply rejected, and every client state the run keeps,
    residuals included, is one a checkpoint accepts."""
    sim = run_tiny(name, "uplink.codec=int4", "uplink.rounding=stochastic", "uplink.error_feedback=true",
                   "downlink.codec=int8", *PLAIN_SGD.get(name, ()))
    assert all(not r.get("rejected") for r in sim.history), name
    for k in sim.store:
        assert sim.state_schema(k).problem(sim.store[k]) is None, (name, k)
    if sim.method.communicates and not sim.method.pooled:
        assert any(key.startswith("uplink.residual/") for k in sim.store for key in sim.store[k]), name


def test_heterogeneous_ranks_keep_each_clients_residuals_at_its_rank():
    sim = run_tiny("hetlora", "lora.ranks=[1,2]", "uplink.codec=topk", "uplink.error_feedback=true",
                   "uplink.lossless=zlib", "run.rounds=3")
    assert all(not r.get("rejected") for r in sim.history)
    for k in sim.store:
        rank = sim.cfg.client_ranks()[k]
        residuals = {key: t for key, t in sim.store[k].items() if key.endswith(".lora_A")}
        assert residuals and all(t.shape[0] == rank for t in residuals.values()), k


def test_compare_shows_the_codec_column_only_when_a_codec_is_set():
    from fedlowrank.experiments.compare import results_markdown, run_comparison

    coded = run_comparison("tiny", ["fedit", "ffa-lora"], [0], ["run.rounds=1", "uplink.codec=int8"])
    plain = run_comparison("tiny", ["fedit", "ffa-lora"], [0], ["run.rounds=1"])
    assert all(r["codec"] == "int8 uniform b64 nearest / fp32" for r in coded["rows"])
    assert all("codec" not in r for r in plain["rows"])
    assert "| codec (up / down) |" in results_markdown(coded) and "codec" not in results_markdown(plain)
    assert all(c["bytes_up"] < 0.8 * p["bytes_up"] for c, p in zip(coded["rows"], plain["rows"]))
