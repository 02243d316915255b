"""Client cohorts (``run.cohort``, runtime/cohort.py): several sampled clients trained together, one forward and
backward per step over the shared backbone, equal one client at a time (to float rounding) for every method that
declares ``supports_cohorts``; the others, and the networks and settings a joint step cannot do, train one at a
time."""

from __future__ import annotations

import json
import threading
from functools import lru_cache

import pytest
import torch
from torch import nn

from fedlowrank.config import ConfigError, load_config
from fedlowrank.methods import available_methods, get_method
from fedlowrank.runtime.plan import cohort_size
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task

COHORT_METHODS = sorted(n for n, c in available_methods().items() if c.supports_cohorts)
ONE_AT_A_TIME = sorted(n for n, c in available_methods().items() if not c.supports_cohorts)
# the server re-factors the averaged ΔW by a truncated SVD: its factors' entries move by rounding / (singular-value
# gap), so two float32 orders of the same sums agree to a few 1e-5, not to 1e-5 (measured: 1.03e-5 on |A| ≤ 0.31)
SVD_ATOL = {"flexlora": 5e-5}
CORRECTIONS = ("fedprox+scaffold", "fedprox", None)  # the most each method allows (tried in this order)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def without_dropout(task):
    """``task`` with every dropout of its backbone off: one-at-a-time and joint forwards then draw no random
    numbers, so they can be compared."""
    for m in task.loaded.net.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return task


@lru_cache(maxsize=None)
def text_task():
    return without_dropout(build_task(load_config("tiny")))


@pytest.fixture(scope="module")
def lm_sets(tmp_path_factory) -> list[str]:
    """The ``tiny-lm`` config on 40 short instruction pairs of different lengths (from 1 to 7 words and 1 to 4
    answers), 4 clients; the task is built once (:func:`lm_task`)."""
    folder = tmp_path_factory.mktemp("pairs")
    rows = [{"prompt": f"q{i} " + "word " * (i % 7), "completion": f"a{i} " * (1 + i % 4) + f"#### {i}"}
            for i in range(48)]
    for split, part in (("train", rows[:40]), ("test", rows[40:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return ["data.source=files", f"data.train={folder / 'train.jsonl'}", f"data.test={folder / 'test.jsonl'}",
            "data.prompt_column=prompt", "data.response_column=completion", "data.max_train_examples=0",
            "partition.kind=iid", "task.options.eval_generate=0", "run.device=cpu"]


@lru_cache(maxsize=None)
def lm_task(sets: tuple[str, ...]):
    return without_dropout(build_task(load_config("tiny-lm", list(sets))))


def simulate(config: str, task, cohort: int, sets: list[str], run_dir=None) -> Simulation:
    sim = Simulation(load_config(config, [*sets, f"run.cohort={cohort}"]), task=task, run_dir=run_dir)
    sim.run()
    return sim


def method_sets(method: str, config: str, task, base: list[str]) -> list[str]:
    """``base`` plus the strongest client correction ``method`` accepts with these settings."""
    if "correction" not in get_method(method).options():
        return base
    for correction in CORRECTIONS:
        sets = base + ([f"method.correction={correction}"] if correction else [])
        try:
            Simulation(load_config(config, sets), task=task)
        except ValueError:
            continue
        return sets
    raise AssertionError(f"{method}: no correction accepted")


def assert_close_state(key: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """``actual`` equals ``expected`` to float rounding. A FLoRG factor ``A`` (``*.gram_A``) is compared through
    its Gram matrix ``AᵀA``, all the model uses (ΔW = s·L AᵀA R): the server's canonical factor is defined up to
    an orthogonal transformation of its rows (SVD signs, rotations among close singular values), which rounding
    and LAPACK builds choose differently; ``atol`` is carried to ``AᵀA`` to first order (2·max|A|·atol)."""
    if key.endswith(".gram_A") and expected.dim() == 2:
        assert actual.shape == expected.shape, key
        scale = float(expected.abs().max())
        actual, expected = (a.double().T @ a.double() for a in (actual, expected))
        atol = 2 * scale * atol
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=key)


def assert_same_run(one, joint, rtol: float = 1.3e-6, atol: float = 1e-5) -> None:
    """Same global state and client states (to float rounding); the same ledger."""
    assert one.server.keys() == joint.server.keys()
    for key, value in one.server.items():
        if isinstance(value, torch.Tensor):
            assert_close_state(key, joint.server[key], value, rtol, atol)
        else:
            assert joint.server[key] == value, key
    assert sorted(one.store) == sorted(joint.store)
    for k in one.store:
        a, b = one.store[k], joint.store[k]
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert_close_state(f"client {k}: {key}", b[key], a[key], rtol, atol)
            else:
                assert b[key] == a[key], key
    assert joint.ledger.rows == one.ledger.rows


@pytest.mark.parametrize("method", COHORT_METHODS)
def test_cohort_equals_one_at_a_time_on_text_classification(method, tmp_path):
    """Four clients of different sizes (Dirichlet; one epoch each, so different step counts), mixed ranks where the
    method has them, per-client clipping and the strongest correction the method takes: cohorts of 3 then 1."""
    task = text_task()
    base = [f"method.name={method}", "run.clients_per_round=4", "train.local_epochs=0.3", "train.max_grad_norm=0.05"]
    if available_methods()[method].supports_heterogeneous_ranks:
        base.append("lora.ranks=[1,2,2,1]")
    sets = method_sets(method, "tiny", task, base)
    one = simulate("tiny", task, 1, sets, tmp_path / "one")
    joint = simulate("tiny", task, 3, sets, tmp_path / "joint")
    assert joint.cohort_size() == 3
    assert_same_run(one, joint, atol=SVD_ATOL.get(method, 1e-5))
    assert (tmp_path / "joint" / "ledger.jsonl").read_bytes() == (tmp_path / "one" / "ledger.jsonl").read_bytes()
    assert [r["train_loss"] for r in joint.history] == pytest.approx([r["train_loss"] for r in one.history])


@pytest.mark.parametrize("method, ranks", [("fedit", []), ("hetlora", ["lora.ranks=[1,2,2,1]"])])
def test_members_with_batches_of_different_sizes(method, ranks):
    """Batches of 32 from clients of 11, 43, 66 and 80 examples: the members' rows differ, so each member's adapter
    runs on its own rows (no batched product over the members)."""
    task = text_task()
    sets = [f"method.name={method}", "run.clients_per_round=4", "train.batch_size=32", *ranks]
    one, joint = simulate("tiny", task, 1, sets), simulate("tiny", task, 4, sets)
    assert sorted(len(p) for p in joint.parts) == [11, 43, 66, 80]
    assert_same_run(one, joint)


@pytest.mark.parametrize("method", COHORT_METHODS)
def test_cohort_equals_one_at_a_time_on_causal_lm(method, lm_sets):
    """tiny-llama on instruction pairs of different lengths: the members' batches are padded to the longest."""
    task = lm_task(tuple(lm_sets))
    base = [*lm_sets, f"method.name={method}", "run.clients_per_round=4", "train.max_grad_norm=0.05"]
    if available_methods()[method].supports_heterogeneous_ranks:
        base.append("lora.ranks=[1,2,2,1]")
    sets = method_sets(method, "tiny-lm", task, base)
    one, joint = simulate("tiny-lm", task, 1, sets), simulate("tiny-lm", task, 4, sets)
    assert joint.cohort_size() == 4
    assert_same_run(one, joint)


def test_gram_factors_compare_by_their_gram_matrix(lm_sets):
    """Clients whose FLoRG factors are rotated (``Q·Aₙ``, Q orthogonal: the same ``AₙᵀAₙ``, hence the same Gram sum
    and the same model) lead the no-Procrustes server to another canonical factor (rows flipped or rotated by
    O(max|A|)): the comparison of runs must hold through ``AᵀA`` on any platform, whose rounding and LAPACK pick
    among these factors as the rotation does here."""
    task = lm_task(tuple(lm_sets))

    def rotate(rnd, client, reply):
        for key, value in reply.tensors().items():
            if key.endswith(".gram_A"):
                g = torch.Generator().manual_seed(client)
                q = torch.linalg.qr(torch.randn(len(value), len(value), generator=g, dtype=torch.float64))[0]
                reply[key] = (q @ value.double()).to(value.dtype)
        return reply

    sets = [*lm_sets, "method.name=florg-no-procrustes", "run.clients_per_round=4", "run.rounds=1"]
    plain = simulate("tiny-lm", task, 1, sets)
    rotated = Simulation(load_config("tiny-lm", [*sets, "run.cohort=1"]), task=task, tamper=rotate)
    rotated.run()
    key = next(k for k in plain.server if k.endswith(".gram_A"))
    assert float((plain.server[key] - rotated.server[key]).abs().max()) > 1e-3  # another factor ...
    assert_same_run(plain, rotated)                                             # ... of the same model


@pytest.mark.parametrize("model", ["tiny-vit", "resnet20"])
def test_cohort_equals_one_at_a_time_on_images(model):
    """A ViT, and a ResNet whose adapted targets are convolutions and whose head includes its GroupNorms."""
    import test_image

    task = without_dropout(test_image.image_task(model))
    runs = []
    for cohort in (1, 4):
        cfg = test_image.image_config("fedit", rounds=2, per_round=4, model=model, correction="fedprox+scaffold")
        cfg.run.cohort = cohort
        sim = Simulation(cfg, task=task)
        sim.run()
        runs.append(sim)
    assert runs[1].cohort_size() == 4
    assert_same_run(*runs)


def test_members_share_the_frozen_backbone_and_own_adapters_and_head():
    sim = Simulation(load_config("tiny", ["run.cohort=2"]), task=text_task())
    view = sim.model.shared_copy()
    own = {id(p) for p in sim.model.own_parameters()}
    assert len(own) == len(view.own_parameters()) > 0
    for (name, p), q in zip(sim.model.named_parameters(), view.parameters()):
        assert (p is q) == (id(p) not in own), name


@pytest.mark.parametrize("method", ONE_AT_A_TIME)
def test_methods_without_cohorts_train_one_at_a_time(method):
    lines: list[str] = []
    extra = ["train.optimizer=sgd"] if method in ("ssf", "fedsub") else []
    sim = Simulation(load_config("tiny", [f"method.name={method}", "run.cohort=4", *extra]), task=text_task(),
                     log=lines.append)
    assert sim.cohort_size() == 1
    assert lines == [f"[{method}] run.cohort = 4: method {method!r} trains one client at a time (it has its own "
                     f"train, not the two phases prepare_fit and finish_fit); clients train one at a time"]


def test_a_method_without_cohorts_gives_the_one_at_a_time_run():
    sets = [f"method.name={ONE_AT_A_TIME[0]}", "run.clients_per_round=4"]
    assert_same_run(simulate("tiny", text_task(), 1, sets), simulate("tiny", text_task(), 4, sets), rtol=0, atol=0)


def test_automatic_cohort_is_the_round_on_cuda_and_one_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))  # room for all
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    cfg = load_config("tiny", ["run.clients_per_round=3"])
    sim = Simulation(cfg, task=text_task())
    assert cohort_size(cfg, sim.method, sim.task, sim.model, torch.device("cpu")) == (1, "", False)
    assert cohort_size(cfg, sim.method, sim.task, sim.model, torch.device("cuda"))[:2] == (3, "")
    cfg = load_config("tiny", ["privacy.dpsgd=true"])
    assert cohort_size(cfg, sim.method, sim.task, sim.model, torch.device("cuda"))[0] == 1


def test_batch_normalisation_trains_one_at_a_time():
    cfg = load_config("tiny", ["run.cohort=2"])
    sim = Simulation(cfg, task=text_task())
    sim.model.net.bert.pooler.add_module("norm", nn.BatchNorm1d(32))
    assert cohort_size(cfg, sim.method, sim.task, sim.model, sim.device) == (
        1, "the network's batch normalisation would mix the clients' rows", False)


def test_with_dropout_a_cohort_is_deterministic():
    sets = ["run.clients_per_round=4"]
    task = build_task(load_config("tiny"))  # dropout 0.1 in the backbone: masks from the cohort's stream
    assert_same_run(simulate("tiny", task, 4, sets), simulate("tiny", task, 4, sets), rtol=0, atol=0)


@pytest.mark.parametrize("value, message", [
    ("-1", "run.cohort must be >= 0 (0 = automatic, 1 = one client at a time, N = up to N clients together), "
           "got -1"),
    ("'all'", "run.cohort must be an integer, got 'all'"),
    ("2.5", "run.cohort must be an integer, got 2.5"),
])
def test_bad_cohort_values_are_named(value, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"run.cohort={value}"])
    assert str(err.value) == message


def test_dpsgd_refuses_an_explicit_cohort():
    with pytest.raises(ConfigError, match=r"run.cohort = 2 with privacy.dpsgd: DP-SGD clips per example"):
        load_config("tiny", ["run.cohort=2", "privacy.dpsgd=true"])
    load_config("tiny", ["run.cohort=0", "privacy.dpsgd=true"])


def test_a_cohort_trains_in_the_calling_thread_and_a_failing_member_raises(lm_sets, monkeypatch):
    """No thread is started to train a cohort (the members' two phases run in order around the joint steps, in the
    caller's thread); a member whose method fails while preparing its fit raises out of the round."""
    task = lm_task(tuple(lm_sets))
    started: list[threading.Thread] = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))
    sets = [*lm_sets, "method.name=fedprox", "run.clients_per_round=4", "run.rounds=1"]
    sim = simulate("tiny-lm", task, 4, sets)
    assert sim.cohort_size() == 4 and started == []
    failing = Simulation(load_config("tiny-lm", [*sets, "run.cohort=4"]), task=task)
    calls = []

    def prepare(model, msg, state, trainer):
        calls.append(trainer.client)
        if len(calls) == 2:
            raise KeyError("boom")
        return type(failing.method).prepare_fit(failing.method, model, msg, state, trainer)
    monkeypatch.setattr(failing.method, "prepare_fit", prepare)
    with pytest.raises(KeyError, match="boom"):
        failing.run()
    assert len(calls) == 2 and started == []


@needs_cuda
def test_cohort_on_cuda_matches_one_at_a_time_on_the_cpu():
    task = text_task()
    sets = ["method.name=fedit", "run.clients_per_round=4", "train.local_epochs=0.3", "method.correction=fedprox"]
    cpu = simulate("tiny", task, 1, sets)
    gpu = simulate("tiny", task, 0, [*sets, "run.device=cuda"])
    assert gpu.cohort_size() == 4
    assert_same_run(cpu, gpu, rtol=1e-4, atol=1e-5)
