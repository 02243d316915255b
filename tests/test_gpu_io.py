"""Transfers and compilation of the GPU path, proven on the CPU: a local step neither moves a tensor nor reads the
device (its inputs staged ahead of it), and on CUDA (skipped without it) no synchronisation of ours in a round."""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np
import pytest
import torch

from fedlowrank import device
from fedlowrank.adapters.model import Routing
from fedlowrank.config import load_config
from fedlowrank.device import local_step, stage, step_transfers, to_device
from fedlowrank.runtime import cohort
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.training import local

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LM = ["task.options.eval_generate=0", "partition.num_clients=8", "run.clients_per_round=8", "run.rounds=1",
      "train.max_grad_norm=1.0"]


@lru_cache(maxsize=None)
def lm_task(pack: int = 0):
    return build_task(load_config("tiny-lm", [*LM, f"task.options.pack={pack}"]))


# -- item 1: a local step moves nothing and reads nothing ---------------------------------------------------------
def test_the_counter_sees_moves_host_data_and_reads_inside_a_step_only():
    """What the old step did inside it: ``.to(device)`` of a batch, ``torch.tensor`` of host lists and the routing's
    ``int(counts.max())``; outside a step nothing counts."""
    batch, tokens = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}, torch.tensor([[0, 0, 1, -1]])

    def work():
        to_device(batch, torch.device("cpu"))
        Routing(rows=[slice(0, 1), slice(1, 3)]).member_of_rows(torch.device("cpu"))
        Routing(tokens=tokens, size=2).gather(torch.device("cpu"))

    def steps():
        work()
        with local_step():
            work()
    counts = step_transfers(steps)
    assert counts["steps"] == 1
    assert counts["moves"] == 1 + 1 + 2 and counts["host_data"] == 1 and counts["reads"] >= 2, counts
    assert dict(step_transfers(lambda: stage(batch, torch.device("cpu")))) == {"steps": 0}


@pytest.mark.parametrize("size, pack", [(1, 0), (8, 0), (8, 1536)])
def test_a_local_step_moves_no_tensor_and_reads_no_device_value(size, pack):
    """A round of 8 tiny-llama clients, one at a time or as one cohort (padded, or packed with rows mixing the
    members): inside every local step (forward, backward, clipping, optimizer), no ``.to(device)``, no tensor from
    host data and no host read of a device value by our code; the inputs were staged before."""
    sim = Simulation(load_config("tiny-lm", [*LM, f"run.cohort={size}", f"task.options.pack={pack}"]),
                     task=lm_task(pack))
    counts = step_transfers(sim.run_round)
    assert sim.cohort_size() == size
    assert counts["steps"] == (16 if size == 1 else 2), counts
    assert counts["moves"] == counts["host_data"] == counts["reads"] == 0, counts


def test_staged_inputs_hold_the_loss_positions_and_give_the_host_batch_s_loss():
    """:meth:`CausalLM.device_batch`: token ids, mask, and the response positions found on the host; the loss of a
    staged batch is the loss of the host batch (which is staged by the task itself)."""
    task = lm_task()
    net = task.build_model().net
    batch = task.batch(np.arange(4))
    staged = task.device_batch(batch, torch.device("cpu"))
    assert set(staged) == {"input_ids", "attention_mask", "response_at", "response_tokens"}
    assert len(staged["response_at"]) == int((batch["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(task.loss(net, staged), task.loss(net, batch), rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("size", [1, 4])
def test_on_cuda_a_round_s_local_steps_never_synchronise_in_our_code(size, monkeypatch):
    """CUDA's synchronisation checker (``torch.cuda.set_sync_debug_mode``) inside every local step of a round: no
    warning from our code (a model's own mask checks are transformers'); staged inputs come from pinned memory."""
    def checked_step():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with local_step():
                yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    from contextlib import contextmanager
    monkeypatch.setattr(local, "local_step", contextmanager(checked_step))
    monkeypatch.setattr(cohort, "local_step", contextmanager(checked_step))
    sets = [*LM, "run.device=cuda", "train.dtype=bf16", f"run.cohort={size}", "run.clients_per_round=4",
            "task.options.pack=1536"]
    sim = Simulation(load_config("tiny-lm", sets), task=lm_task(1536))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim.run_round()
    ours = [w for w in caught if "synchroniz" in str(w.message) and "/fedlowrank/" in w.filename]
    assert not ours, [(w.filename, w.lineno, str(w.message)[:80]) for w in ours]
    assert device.stage_tensor(torch.zeros(2), torch.device("cuda")).device.type == "cuda"


# -- item 4: compilation decided and contained ----------------------------------------------------------------------
@pytest.fixture
def fast_compile(monkeypatch):
    """torch.compile with the ``aot_eager`` backend (traced graphs, no code generation); dynamo reset around."""
    import torch._dynamo

    monkeypatch.setattr(device, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_a_finished_run_releases_its_compiled_network(fast_compile):
    """A compiled run's network (and with it its graphs) is freed once the run is over: the compiled call no
    longer holds it."""
    import gc
    import weakref

    sim = Simulation(load_config("tiny-lm", [*LM, "run.compile=true", "run.clients_per_round=2"]), task=lm_task())
    sim.run()
    assert fast_compile["stats"]["unique_graphs"] >= 1
    decoder = weakref.ref(sim.model.net.get_decoder())
    del sim
    gc.collect()
    assert decoder() is None


@pytest.mark.parametrize("sets, where, compiled", [
    ([], "cpu", False),                                                     # never on the CPU
    ([], "cuda", False),                                                    # no buckets: no static shapes
    (["task.length_buckets=[256, 512]"], "cuda", False),                    # 2 rounds × 2 steps per bucket
    (["task.length_buckets=[256, 512]", "run.rounds=800"], "cuda", True),   # 800 steps per bucket
    (["task.length_buckets=[256, 512]", "run.rounds=800", "run.cohort=1"], "cuda", True),
    (["task.length_buckets=[128, 256, 512, 768]", "run.rounds=400"], "cuda", False),  # 2 buckets would pay
    (["run.compile=true"], "cpu", True),
    (["task.length_buckets=[256]", "run.rounds=2000", "run.compile=false"], "cuda", False),
])
def test_run_compile_auto_compiles_when_the_steps_per_bucket_repay_the_warm_up(sets, where, compiled):
    """``run.compile = auto`` (the default): compiled on CUDA with length buckets when the planned steps per bucket
    reach the measured break-even (≈ 766); the rule is one line; true and false are obeyed."""
    cfg = load_config("tiny-lm", ["run.clients_per_round=2", *sets])
    wanted, rule = device.compile_decision(cfg, lm_task(), torch.device(where))
    assert wanted is compiled and rule.startswith("run.compile = ") and "\n" not in rule
    steps = cfg.run.rounds * cfg.train.local_steps * (2 if cfg.run.cohort == 1 else 1)
    assert device.planned_steps(cfg, lm_task()) == steps
    if cfg.run.compile == "auto" and cfg.task.length_buckets and where == "cuda":
        per_bucket = steps / len(cfg.task.length_buckets)
        assert f"= {per_bucket:.0f} per bucket" in rule and str(device.COMPILE_BREAK_EVEN) in rule
        fewer = steps // device.COMPILE_BREAK_EVEN
        assert (f"; {fewer} length bucket(s) would repay it" in rule) == (not compiled and fewer >= 1)


# -- item 3 (in part): a compiled packed cohort step has no graph break -------------------------------------------------
@pytest.mark.slow  # ≈ 70 s on one CPU thread
def test_a_compiled_packed_cohort_has_no_graph_break_and_equals_eager(fast_compile):
    """The routing's gather and the response positions are prepared before the step, so the compiled decoder of a
    packed cohort (rows mixing members) traces without a break (the step that computed them inside broke 12 times
    in its first round); two rounds equal the eager run."""
    sets = [*LM, "task.options.pack=768", "task.length_buckets=[512, 768]", "run.cohort=2", "run.clients_per_round=2",
            "run.rounds=2"]
    task = build_task(load_config("tiny-lm", sets))
    compiled = Simulation(load_config("tiny-lm", ["run.compile=true", *sets]), task=task)
    compiled.run()
    assert fast_compile["stats"]["unique_graphs"] >= 1 and sum(fast_compile["graph_break"].values()) == 0
    eager = Simulation(load_config("tiny-lm", sets), task=task)
    eager.run()
    for key, value in eager.server.tensors().items():
        torch.testing.assert_close(compiled.server[key], value, rtol=1e-5, atol=1e-7, msg=key)
