"""What a cohort's step and round cost, proven on the CPU on SmolLM2's full 30-layer shape (``arch:smollm2-135m``,
random weights, bf16): the aten operations of one joint step do not grow with the members, and one client's step
dispatches no more than a plain peft step of the same model."""

from __future__ import annotations

import copy
import json
from functools import lru_cache

import pytest
import torch
from torch import nn

from fedlowrank.config import load_config
from fedlowrank.execution.measure import LOCAL_STEP, dispatched_ops
from fedlowrank.message import State
from fedlowrank.runtime.cohort import Cohort, Joint, cohort_members
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.training.local import Alone, LocalSteps

SMOLLM2 = ["task.model=arch:smollm2-135m", "train.dtype=bf16", "task.max_length=64", "train.batch_size=1",
           "train.max_grad_norm=1.0", "partition.kind=iid", "partition.min_partition_size=1",
           "task.options.eval_generate=0", "task.options.eval_examples=1", "run.eval_every=100"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> list[str]:
    """64 short instruction pairs (a few byte tokens each: the counts do not depend on the tokens, the time does)."""
    folder = tmp_path_factory.mktemp("short-pairs")
    rows = [{"prompt": f"q{i} " + "w " * (i % 3), "completion": f"a{i} #### {i}"} for i in range(68)]
    for split, part in (("train", rows[:64]), ("test", rows[64:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return ["data.source=files", f"data.train={folder / 'train.jsonl'}", f"data.test={folder / 'test.jsonl'}",
            "data.prompt_column=prompt", "data.response_column=completion", "data.max_train_examples=0"]


@lru_cache(maxsize=None)
def smollm2_task(sets: tuple[str, ...]):
    return build_task(load_config("tiny-lm", list(sets)))


def smollm2_simulation(pairs: list[str], clients: int, *extra: str) -> Simulation:
    sets = (*pairs, *SMOLLM2, f"partition.num_clients={clients}", f"run.clients_per_round={clients}",
            f"run.cohort={clients}", *extra)
    return Simulation(load_config("tiny-lm", list(sets)), task=smollm2_task(tuple(pairs + SMOLLM2)))


def joint_step_ops(sim: Simulation, size: int) -> int:
    """Top-level aten operations of one joint step of ``size`` FedIT members (their phases as a round prepares
    them; one alone for ``size`` 1), a multi-tensor optimizer kernel once; its inputs' staging not counted."""
    clients = list(range(size))
    msgs = [sim.method.broadcast(sim.server, k, 1) for k in clients]
    cohort = Cohort(sim.model, size)
    members = cohort_members(sim.method, cohort, msgs, [State() for _ in clients], sim.task,
                             [sim.parts[k] for k in clients], sim.cfg, clients, 1, sim.training_plan())
    steps = LocalSteps(members, Joint(cohort, members, seed=0) if size > 1 else Alone(members[0]))
    return sum(dispatched_ops(lambda: steps.step(0), within=LOCAL_STEP, top_level=True).values())


def plain_peft_step_ops(sim: Simulation) -> int:
    """The same count for a plain peft + torch step on client 0's batch (already on the device): LoRA on q/v at the
    run's rank, the model's own loss, clipping, AdamW; the backbone in bf16, the adapters fp32."""
    from peft import LoraConfig, get_peft_model

    net = copy.deepcopy(sim.task.loaded.net).to(torch.bfloat16)
    net = get_peft_model(net, LoraConfig(r=sim.cfg.lora.rank, lora_alpha=sim.cfg.lora.alpha, lora_dropout=0.0,
                                         target_modules=["q_proj", "v_proj"])).train()
    trained = [p for p in net.parameters() if p.requires_grad]
    for p in trained:
        p.data = p.data.float()
    opt = torch.optim.AdamW(trained, lr=1e-3)
    batch = sim.task.batch(sim.parts[0][:1])

    def step():
        opt.zero_grad(set_to_none=True)
        net(**batch).loss.backward()
        nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
    return sum(dispatched_ops(step, top_level=True).values())


@pytest.mark.slow  # ≈ 60 s on one CPU thread: 32 members on SmolLM2's 30 layers
def test_a_joint_step_s_operations_do_not_grow_with_the_members_and_one_client_s_match_plain_peft(pairs):
    """One joint step of 32 FedIT members dispatches within 2 % of the operations of one of 2 (120 LoRA factors
    per member, per-member clipping): the factors are stacked per factor group, the optimizer and the clipping run
    over the stacks, nothing is handed out per member. One client alone stays within 1.05× a plain peft step."""
    sim = smollm2_simulation(pairs, 32)
    assert sim.cohort_size() == 32
    two, many = joint_step_ops(sim, 2), joint_step_ops(sim, 32)
    assert many <= 1.02 * two, (two, many)
    one = joint_step_ops(sim, 1)
    assert one <= 1.05 * plain_peft_step_ops(sim), one


@pytest.mark.parametrize("cohort", [1, 2])
def test_a_compiled_step_is_one_graph_per_shape_with_the_loss_inside_and_no_break_over_three_rounds(cohort,
                                                                                                   monkeypatch):
    """``run.compile`` on tiny-llama with length buckets, one client at a time or a cohort of 2 packed in static
    shapes, 3 rounds: the decoder, the head at the response positions and the cross-entropy are one graph (the loss
    has no autograd call inside, and a fixed number of positions per shape), compiled once (frames, graphs) in round
    1, with no graph break and nothing compiled again in rounds 2 and 3."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fedlowrank.execution import compiling

    graphs = []

    def recording(gm, example_inputs):  # every call of a graph, its subgraphs' (the loss's forward body) included
        graphs.append({str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                       for n in m.graph.nodes})
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    monkeypatch.setattr(compiling, "COMPILE_BACKEND", recording)
    torch._dynamo.reset()
    counters.clear()
    sets = ["task.options.eval_generate=0", "task.length_buckets=[512, 768]", f"run.cohort={cohort}",
            "run.clients_per_round=2", "run.rounds=3", "train.max_grad_norm=1.0", "run.compile=true",
            *(["task.options.pack=768"] if cohort > 1 else [])]
    sim = Simulation(load_config("tiny-lm", sets), task=build_task(load_config("tiny-lm", sets)))
    try:
        per_round = []
        for _ in range(3):
            sim.run_round()
            per_round.append((counters["frames"]["total"], counters["stats"]["unique_graphs"]))
        assert sim.cohort_size() == cohort
        assert per_round[0] == per_round[1] == per_round[2] and per_round[0][0] == len(graphs) >= 1, per_round
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert all(any("cross_entropy" in t for t in g) and any("index_select" in t for t in g) for g in graphs)
    finally:
        sim.close()
        torch._dynamo.reset()


def test_reductions_over_many_tensors_equal_the_dense_ones():
    """:func:`all_finite` and :func:`total_norm` against the concatenated tensors (one float64 vector)."""
    from fedlowrank.linalg.reductions import all_finite, total_norm

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64),
               torch.zeros(0, dtype=torch.float64), torch.arange(4)]
    dense = torch.cat([t.flatten().double() for t in tensors[:3]])
    assert total_norm(tensors[:3]) == pytest.approx(float(dense.norm()), rel=1e-12)
    assert total_norm([]) == 0.0 and all_finite([]) and all_finite(tensors)
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = [t.clone() for t in tensors]
        broken[1][2] = bad
        assert not all_finite(broken)
    assert all_finite([torch.full((2,), 3e38)])  # large but finite (its 2-norm overflows in float32)


def test_the_server_reads_each_reply_at_most_twice_not_once_per_tensor():
    """A round of 4 FedIT clients on tiny-llama (8 LoRA factors each), with the outlier check on: the checks of a
    reply (finiteness) and its update norm read the host once each per reply, not once per tensor."""
    from torch.profiler import ProfilerActivity, profile

    sim = Simulation(load_config("tiny-lm", ["task.options.eval_generate=0", "run.clients_per_round=4",
                                             "run.rounds=1", "partition.kind=iid"]), task=build_task(load_config(
                                                 "tiny-lm", ["task.options.eval_generate=0"])))
    assert len(sim.server.tensors()) >= 8
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sim.run_round()

    def in_server_part(event) -> bool:
        while event is not None:
            if event.name in ("fedlowrank.receive", "fedlowrank.close_round"):
                return True
            event = event.cpu_parent
        return False
    reads = sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense" and in_server_part(e))
    assert reads <= 2 * 4, reads


def round_ops_per_member(*sets: str) -> tuple[dict[str, float], int]:
    """``(ops, tensors)``: the top-level aten operations one round of tiny-llama's FedIT dispatches outside its local
    steps per client (the difference between rounds of 4 and of 2 clients, halved), by the innermost part of the
    round they run in (``wire``, ``receive``, ``close_round``, ...), and the tensors of one reply."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for k in (2, 4):
        cfg = load_config("tiny-lm", ["task.options.eval_generate=0", "run.eval_every=100", "partition.kind=iid",
                                      f"run.clients_per_round={k}", "run.rounds=3", "server.outlier_ratio=10", *sets])
        sim = Simulation(cfg, task=build_task(cfg))
        try:
            sim.run_round()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                sim.run_round()
            tensors = len(sim.server.tensors())
        finally:
            sim.close()
        count: dict[str, int] = {}
        for event in prof.events():
            names, parent = [], event.cpu_parent
            while parent is not None:
                names.append(parent.name)
                parent = parent.cpu_parent
            if not event.name.startswith("aten::") or LOCAL_STEP in names or any(n.startswith("aten::")
                                                                                 for n in names):
                continue
            part = next((n.removeprefix("fedlowrank.") for n in names if n.startswith("fedlowrank.")), "other")
            count[part] = count.get(part, 0) + 1
        counts[k] = count
    return {part: (counts[4].get(part, 0) - counts[2].get(part, 0)) / 2 for part in counts[4]}, tensors


def test_a_round_s_work_per_client_outside_its_steps_does_not_grow_with_the_tensors_it_sends():
    """tiny-llama's FedIT on q/v and on every attention projection (twice the factors), the outlier check on: the
    server's checks, update norm and aggregation of a reply are a few multi-tensor operations whatever its number of
    tensors (not several per tensor); the wire parses a message with at most one operation (its shape) per tensor,
    copying none; a client loads its message with one multi-tensor copy, so its update outside the steps costs at
    most one operation more per tensor (its reply's copy)."""
    few, few_tensors = round_ops_per_member("lora.targets=[\"q_proj\", \"v_proj\"]")
    many, many_tensors = round_ops_per_member("lora.targets=[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"]")
    assert many_tensors == 2 * few_tensors >= 8, (few_tensors, many_tensors)
    server = {part: few.get(part, 0) + many.get(part, 0) for part in ("receive", "close_round")}
    assert few["receive"] == many["receive"] and few["close_round"] == many["close_round"], (few, many)
    assert few["receive"] + few["close_round"] <= 16, server
    assert many["client_update"] - few["client_update"] <= many_tensors - few_tensors, (few, many)
    for ops, tensors in ((few, few_tensors), (many, many_tensors)):
        assert ops["wire"] <= 2 * tensors, ops  # a broadcast and a reply: one shape each per tensor
