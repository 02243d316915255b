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
from fedlowrank.device import stage, to_device
from fedlowrank.execution import compiling
from fedlowrank.execution.measure import local_step, step_transfers
from fedlowrank.runtime import plan
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.tasks.causal_lm import PackShapes, collate
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

    monkeypatch.setattr(compiling, "COMPILE_BACKEND", "aot_eager")
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
    cohort = cfg.run.cohort or cfg.run.clients_per_round
    wanted, rule = plan.compile_decision(cfg, lm_task(), torch.device(where), cohort)
    assert wanted is compiled and rule.startswith("run.compile = ") and "\n" not in rule
    steps = cfg.run.rounds * cfg.train.local_steps * (2 if cfg.run.cohort == 1 else 1)
    assert plan.planned_steps(cfg, lm_task(), cohort) == steps
    if cfg.run.compile == "auto" and cfg.task.length_buckets and where == "cuda":
        per_bucket = steps / len(cfg.task.length_buckets)
        assert f"= {per_bucket:.0f} per bucket" in rule and str(plan.COMPILE_BREAK_EVEN) in rule
        fewer = steps // plan.COMPILE_BREAK_EVEN
        assert (f"; {fewer} length bucket(s) would repay it" in rule) == (not compiled and fewer >= 1)


# -- item 3: packed cohorts in static shapes ---------------------------------------------------------------------
def test_packed_shapes_hold_every_step_in_few_fixed_shapes():
    """:class:`PackShapes`: every step of E examples is laid out in one of the shapes of E examples (each row
    within its width, every example once), the bound last."""
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(40, 400, 300)]
    shapes = PackShapes.of(lengths, 768, [512, 640, 768, 1024])
    assert shapes.buckets == [512, 640]
    for examples in (4, 32):
        allowed = shapes.shapes(examples)
        assert allowed[-1] == (len(shapes.bound(examples)), 768)
        assert [r * w for r, w in allowed] == sorted(r * w for r, w in allowed)
        for _ in range(40):
            step = [lengths[i] for i in rng.choice(len(lengths), examples)]
            rows, width, count = shapes.layout(step)
            assert (count, width) in allowed and len(rows) <= count
            assert sorted(i for row in rows for i in row) == list(range(examples))
            assert max(sum(step[i] for i in row) for row in rows) <= width
        longest = sorted(lengths, reverse=True)[:examples]
        assert shapes.layout(longest)[1:][::-1] in allowed


def test_the_bound_holds_a_step_that_packing_alone_would_spread_over_more_rows(monkeypatch):
    """A step whose own packing needs more rows than the bound's takes the places of the longest examples (each
    item no longer than the training example whose place it takes)."""
    shapes = PackShapes.of([300, 300, 200, 100], 600, [])
    from fedlowrank.tasks import causal_lm
    real = causal_lm.pack_rows
    monkeypatch.setattr(causal_lm, "pack_rows", lambda lengths, capacity: (
        [[i] for i in range(len(lengths))] if lengths == [250, 90, 280, 190] else real(lengths, capacity)))
    step = [250, 90, 280, 190]
    rows, width, count = shapes.layout(step)
    assert (width, count) == (600, 2) and len(rows) == 2
    assert sorted(i for row in rows for i in row) == [0, 1, 2, 3]
    assert max(sum(step[i] for i in row) for row in rows) <= 600


def test_a_fixed_width_routing_pads_each_member_and_refuses_too_many_tokens():
    """``Routing(width=n)``: the gather is ``[K, n]`` whatever the step; a member with more tokens is an error."""
    tokens = torch.tensor([[0, 0, 1, -1], [1, 1, 1, -1]])
    index, valid = Routing(tokens=tokens, size=2, width=5).gather(torch.device("cpu"))
    assert index.shape == valid.shape == (2, 5)
    assert valid.sum(1).tolist() == [2, 4] and index[1, :4].tolist() == [2, 4, 5, 6]
    with pytest.raises(ValueError, match="more than the routing's width 3"):
        Routing(tokens=tokens, size=2, width=3).gather(torch.device("cpu"))


def test_a_packed_cohort_in_static_shapes_gives_each_member_s_loss():
    """With length buckets, packed cohorts of different steps share one shape, with padding rows and a fixed
    routing width, and each member's loss equals its loss unpacked (padding rows carry no loss)."""
    sets = [*LM, "task.options.pack=768", "task.length_buckets=[512, 768]"]
    task = build_task(load_config("tiny-lm", sets))
    net = task.build_model().net
    shapes = set()
    for start in (0, 8):
        batches = [task.batch(np.arange(start + 4 * k, start + 4 * k + 4)) for k in range(2)]
        joined, routing = task.join_batches(batches)
        shapes.add((tuple(joined["input_ids"].shape), routing.gather(torch.device("cpu"))[0].shape))
        out = task.output(net, task.device_batch(joined, torch.device("cpu")))
        losses = task.output_losses(out, routing, joined)
        for k, b in enumerate(batches):
            alone = task.loss(net, collate([task.train[int(i)] for i in b["example_index"]], 0))
            torch.testing.assert_close(losses[k], alone, rtol=1e-4, atol=1e-5)
    assert len(shapes) == 1, shapes


@pytest.mark.slow  # ≈ 100 s on one CPU thread
def test_a_compiled_packed_cohort_compiles_once_per_shape_and_equals_eager(fast_compile):
    """3 rounds of a compiled packed cohort in static shapes (``aot_eager``): one graph per shape used (of at most
    one per bucket below the row length, one of that length and the bound), none new after round 1, no graph
    break, and the eager run's result."""
    sets = [*LM, "task.options.pack=768", "task.length_buckets=[512, 768]", "run.cohort=2", "run.clients_per_round=2",
            "run.rounds=3"]
    task = build_task(load_config("tiny-lm", sets))
    used = set()
    join = task.join_batches

    def recorded(batches):
        joined, routing = join(batches)
        used.add(tuple(joined["input_ids"].shape))
        return joined, routing
    task.join_batches = recorded
    compiled = Simulation(load_config("tiny-lm", ["run.compile=true", *sets]), task=task)
    graphs = []
    for _ in range(3):
        compiled.run_round()
        graphs.append(fast_compile["stats"]["unique_graphs"])
    allowed = {(r, w) for r, w in task.shapes.shapes(8)}                  # 2 members × 4 examples
    assert graphs == [len(used)] * 3 and used <= allowed and len(allowed) <= 3, (graphs, used, allowed)
    assert sum(fast_compile["graph_break"].values()) == 0
    eager = Simulation(load_config("tiny-lm", sets), task=task)
    for _ in range(3):
        eager.run_round()
    for key, value in eager.server.tensors().items():
        torch.testing.assert_close(compiled.server[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("sets, rows", [
    (["run.cohort=2"], 1536),                                              # rows of 2 × task.max_length
    (["run.cohort=2", "task.length_buckets=[512, 768]"], 1536),
    (["run.cohort=2", "task.options.pack=0"], 0),                          # asked off
    (["run.cohort=2", "task.options.pack=900"], 900),                      # asked
    (["run.cohort=1"], 0),                                                 # one client at a time
    ([], 0),                                                               # run.cohort = 0 on the CPU: one at a time
    (["run.cohort=2", "method.name=moon"], 0),                             # reads each example's features
    (["run.cohort=2", "method.name=fedgalore"], 0),                        # trains one client at a time
])
def test_packing_is_the_default_for_causal_lm_cohorts_where_it_is_correct(sets, rows):
    """``task.options.pack = auto`` (the default) packs a run's cohorts, in rows of two longest examples, and
    leaves examples unpacked where packing is not correct: DP-SGD clips each example's gradient and a method such as
    MOON reads each example's representation, neither of which a row holding several examples has; one client at
    a time gains nothing from it."""
    cfg = load_config("tiny-lm", ["task.options.eval_generate=0", *sets])
    assert build_task(cfg, cohorts=plan.packs_cohorts(cfg)).pack == rows


def test_automatic_cohorts_on_cuda_pack_unless_dp_sgd_clips_each_example(monkeypatch):
    """``run.cohort = 0`` trains cohorts on CUDA, so auto packs there, except with DP-SGD (one client at a time, and
    each example's gradient clipped: a packed row holds several)."""
    monkeypatch.setattr(plan, "resolve_device", lambda spec: torch.device("cuda"))
    assert plan.packs_cohorts(load_config("tiny-lm", []))
    assert not plan.packs_cohorts(load_config("tiny-lm", ["privacy.dpsgd=true"]))


def test_auto_packing_stays_off_for_a_model_that_mixes_packed_sequences(monkeypatch):
    """A decoder whose attention would mix sequences packed in one row (no packed-sequence masks) is not packed by
    default; asked explicitly, it is one error line."""
    from fedlowrank.tasks import causal_lm

    monkeypatch.setattr(causal_lm, "keeps_packed_sequences_apart", lambda net: False)
    assert build_task(load_config("tiny-lm", ["task.options.eval_generate=0", "run.cohort=2"]), cohorts=True).pack == 0
    with pytest.raises(ValueError, match="does not keep sequences packed in one row apart"):
        build_task(load_config("tiny-lm", ["task.options.eval_generate=0", "task.options.pack=768"]))


@pytest.mark.parametrize("value", ["'often'", "-1", "true"])
def test_a_bad_pack_option_is_one_error_line(value):
    from fedlowrank.config import ConfigError

    with pytest.raises(ConfigError, match=r"^task.options.pack must be auto or an integer >= 0, got"):
        load_config("tiny-lm", [f"task.options.pack={value}"])
