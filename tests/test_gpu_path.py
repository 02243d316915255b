"""The GPU training path, proven on the CPU: tensors follow their module's device, the backbone in the compute
dtype, the logits-free causal-LM loss, host synchronisations and dispatched operations per step, fused optimizer
steps, length buckets, compiled steps and the cohort memory planner."""

from __future__ import annotations

import copy
from functools import lru_cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlowrank.adapters.gram import GramLinear
from fedlowrank.adapters.lora import LoRALinear
from fedlowrank.config import ConfigError, load_config
from fedlowrank.device import store_frozen
from fedlowrank.execution import compiling
from fedlowrank.execution.measure import dispatched_ops, measured_peak_bytes
from fedlowrank.runtime import plan as planner
from fedlowrank.runtime.cohort import Cohort, Joint
from fedlowrank.runtime.plan import cohort_memory, cohort_size
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.tasks.base import padded_length
from fedlowrank.tasks.causal_lm import IGNORE, LMHead, check_lm_head, check_packing, pack_rows, response_nll
from fedlowrank.training import local
from fedlowrank.training.local import (OPTIMIZERS, Alone, Fit, LocalSteps, LocalTrainer, MemberFit, TrainConfig,
                                      make_optimizer)

from helpers import require_dataset

IID = "partition.kind=iid"  # the tests selected by `-k cuda` need no MiniLM asset (the k-means split's), which
# the GPU machine lacks (benchmarks/gpu_check.sh)


# -- every tensor an adapter makes follows the module's device ------------------------------------------------
def _tensors_on(module: nn.Module, where: str) -> list[str]:
    """Names of the parameters and buffers of ``module`` that are not on device type ``where``."""
    return [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.device.type != where]


@pytest.mark.parametrize("setter", [
    "gram: set_A with more rows",      # florg-no-procrustes: the factor grows to r' rows every round
    "gram: set_A",
    "lora: set_factors of another rank",  # heterogeneous ranks
    "lora: set_factors",
    "set_base_delta",
    "set_frozen_weight",
])
def test_adapter_setters_keep_the_module_s_device(setter):
    """A module on another device (``meta`` here, CUDA in a run) loaded from CPU tensors (messages live on the
    CPU) keeps every parameter and buffer on its device: a CPU tensor left behind is the "mat2 is on cpu" of
    ``self.L @ A.T`` on CUDA."""
    torch.manual_seed(0)
    base = nn.Linear(6, 4)
    if setter.startswith("gram"):
        module = GramLinear(base, torch.randn(4, 4), torch.randn(4, 6), rank=2, scale=1.0)
    else:
        module = LoRALinear(base, rank=2, alpha=4.0)
    module.to("meta")
    if setter == "gram: set_A with more rows":
        module.set_A(torch.randn(3, 4), any_rows=True)
        assert module.gram_A.shape == (3, 4)
    elif setter == "gram: set_A":
        module.set_A(torch.randn(2, 4))
    elif setter == "lora: set_factors of another rank":
        module.set_factors(torch.randn(3, 6), torch.randn(4, 3))
        assert module.rank == 3
    elif setter == "lora: set_factors":
        module.set_factors(torch.randn(2, 6), torch.randn(4, 2))
    elif setter == "set_base_delta":
        module.set_base_delta(torch.randn(4, 6))
    else:
        module.set_frozen_weight(torch.randn(4, 6))
    assert _tensors_on(module, "meta") == []


# -- the causal-LM loss never builds full logits -----------------------------------------------------------------
@lru_cache(maxsize=None)
def lm_task():
    """The bundled ``tiny-lm`` task (tiny LLaMA, 48 GSM8K questions), built once."""
    return build_task(load_config("tiny-lm"))


def full_logits_loss(net, batch) -> torch.Tensor:
    """The reference: every position's logits, then the mean cross-entropy over the response tokens."""
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                           ignore_index=IGNORE)


def test_logits_free_loss_and_gradient_equal_the_full_logits_ones():
    task = lm_task()
    net = task.build_model().net.train()
    trained = [p for n, p in net.named_parameters() if "layers" in n]  # everything but the (tied) head
    for p in trained:
        p.requires_grad_(True)
    batch = task.batch(np.arange(5))
    losses, grads = [], []
    for loss_fn in (task.loss, full_logits_loss):
        loss = loss_fn(net, batch)
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, trained))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_held_out_loss_equals_the_full_logits_one():
    task = lm_task()
    net = task.build_model().net.eval()
    examples = np.arange(10, 23)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in (task.batch(examples[:8]), task.batch(examples[8:])):
            n = int((batch["labels"][:, 1:] != IGNORE).sum())
            total, count = total + float(full_logits_loss(net, batch)) * n, count + n
    assert task.evaluate_examples(net, examples)["loss"] == pytest.approx(total / count, rel=1e-5)


def test_the_head_sees_only_response_positions():
    """The language-model head's input is exactly the hidden states of the positions whose next token is a
    response token (prompt and padding positions never reach it)."""
    task = lm_task()
    net = task.build_model().net
    batch = task.batch(np.arange(4))
    seen: list[torch.Tensor] = []
    handle = net.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        task.loss(net, batch)
    finally:
        handle.remove()
    hidden = net.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    wanted = batch["labels"][:, 1:] != IGNORE
    assert torch.cat(seen).shape[0] == int(wanted.sum()) < wanted.numel() / 2
    torch.testing.assert_close(torch.cat(seen), hidden[:, :-1][wanted])


@pytest.mark.parametrize("scale, softcap", [(1.0, None), (0.5, 2.0)])
def test_response_nll_in_chunks_equals_cross_entropy(scale, softcap):
    """Chunked, with the gradient computed chunk by chunk, and with a logit scale and soft-capping (Gemma's):
    the values and the gradient of autograd through the whole ``[N, V]`` logits (float64)."""
    torch.manual_seed(0)
    head = LMHead(nn.Linear(6, 11, dtype=torch.float64).requires_grad_(False), scale, softcap)
    hidden = (3 * torch.randn(10, 6, dtype=torch.float64)).requires_grad_(True)
    targets = torch.randint(0, 11, (10,))
    weights = torch.rand(10, dtype=torch.float64)
    z = head.module(hidden) * scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(z, targets, reduction="none")
    ref_grad = torch.autograd.grad((ref * weights).sum(), hidden)[0]
    nll = response_nll(hidden, targets, head, rows=3)
    grad = torch.autograd.grad((nll * weights).sum(), hidden)[0]
    torch.testing.assert_close(nll.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)


def test_loss_memory_grows_with_response_tokens_not_vocabulary():
    """Peak bytes allocated by the loss on 512 response tokens of a 4096-word vocabulary: a few chunks of logits
    and the ``[N, H]`` rows, far below the ``[N, V]`` fp32 logits (8 MiB) the full-logits loss holds."""
    torch.manual_seed(0)
    head = LMHead(nn.Linear(16, 4096).requires_grad_(False))
    hidden = torch.randn(512, 16, requires_grad=True)
    targets = torch.randint(0, 4096, (512,))
    full = measured_peak_bytes(lambda: F.cross_entropy(head.logits(hidden), targets).backward(), hidden.device)
    ours = measured_peak_bytes(lambda: response_nll(hidden, targets, head, rows=64).mean().backward(),
                               hidden.device)
    assert full > 512 * 4096 * 4
    assert ours < 6 * 64 * 4096 * 4 + 4 * hidden.numel() * 4 < full / 2


def test_an_architecture_with_other_logits_is_refused():
    net = copy.deepcopy(lm_task().loaded.net)
    check_lm_head(net, "tiny-llama")
    net.config.logit_scale = 2.0  # read by LMHead.of, ignored by LLaMA's forward: the logits would differ
    with pytest.raises(ValueError, match=r"task.model = 'tiny-llama': its logits are not its output embeddings"):
        check_lm_head(net, "tiny-llama")


# -- host reads and dispatched operations per step -------------------------------------------------------------
HOST_READS = ("aten::item", "aten::_local_scalar_dense")


def lm_simulation(*sets: str) -> Simulation:
    return Simulation(load_config("tiny-lm", ["task.options.eval_generate=0", *sets]), task=lm_task())


def fit_run(sim: Simulation, client: int = 0, model=None) -> MemberFit:
    """FedIT's local fit of ``client`` on ``model`` (default: the simulation's), ready to step."""
    model = model or sim.model
    sim.method.load_global(model, sim.server)
    params = sim.method.trainable(model, ("A", "B"))
    model.set_trainable(params)
    trainer = LocalTrainer(sim.task, sim.parts[client % len(sim.parts)], sim.cfg.train, client, 1, 2, 0)
    return MemberFit(trainer, Fit(model, params))


def train_step(member: MemberFit):
    """A call that runs one local step of ``member`` alone (its first step, on its next batch)."""
    steps = LocalSteps([member], Alone(member))
    return lambda: steps.step(0)


def joint_steps(sim: Simulation, members: list[MemberFit], cohort: Cohort | None = None) -> LocalSteps:
    """The joint steps of ``members`` (each on its own view of ``sim``'s model) on ``sim``'s model, in ``cohort``
    (default: a new one)."""
    return LocalSteps(members, Joint(cohort or Cohort(sim.model, len(members)), members, seed=0))


def plain_peft_step(task, batch, kernel: str = "loop"):
    """A plain peft + torch step on ``batch``: LoRA r = 2 on q/v, the model's own loss, clipping, AdamW."""
    from peft import LoraConfig, get_peft_model

    net = get_peft_model(copy.deepcopy(task.loaded.net), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                                  target_modules=["q_proj", "v_proj"])).train()
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3, **({"fused": True} if kernel == "fused" else {}))

    def step():
        opt.zero_grad(set_to_none=True)
        net(**batch).loss.backward()
        nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
    return net, step


@pytest.mark.parametrize("kernel", ["loop", "fused"])
def test_a_local_step_reads_the_device_no_more_than_a_plain_peft_step(kernel, monkeypatch):
    """Our client step (FedIT, clipping) makes no more host reads of tensors than a plain peft step with the same
    optimizer kernel; with the fused kernel (CUDA's) only the model's own forward reads (transformers' mask
    checks): the loss, its count of response tokens, clipping and the optimizer read nothing."""
    monkeypatch.setattr(local, "optimizer_kernel", lambda device: kernel)
    sim = lm_simulation("train.max_grad_norm=1.0")
    run = fit_run(sim)
    batch = sim.task.batch(sim.parts[0][:4])
    run.batches = iter([batch] * 2)
    ours = dispatched_ops(train_step(run))
    net, plain_step = plain_peft_step(sim.task, batch, kernel)
    plain = dispatched_ops(plain_step)
    forward = dispatched_ops(lambda: net(**batch))
    assert sum(ours[k] for k in HOST_READS) <= sum(plain[k] for k in HOST_READS)
    if kernel == "fused":
        assert sum(ours[k] for k in HOST_READS) == sum(forward[k] for k in HOST_READS)


def test_a_cohort_step_dispatches_at_most_1_5x_the_operations_of_one_member(monkeypatch):
    """One joint step of 8 members against one of a single member (the same tiny-llama batches, CUDA's fused
    optimizer kernel): the per-member work is a few operations, and the optimizer steps once for everyone."""
    from fedlowrank.runtime import cohort

    monkeypatch.setattr(cohort, "optimizer_kernel", lambda device: "fused")
    sim = lm_simulation()
    counts = {}
    for size in (1, 8):
        fit = joint_steps(sim, [fit_run(sim, k, sim.model.shared_copy()) for k in range(size)])
        counts[size] = dispatched_ops(lambda: fit.step(0))
        assert counts[size]["Optimizer.step#AdamW.step"] == 1
    total = {size: sum(v for k, v in c.items() if k.startswith("aten::")) for size, c in counts.items()}
    assert total[8] <= 1.5 * total[1], total


# -- fused and multi-tensor optimizer steps ---------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("kernel", ["foreach", "fused"])
def test_fused_and_foreach_steps_equal_the_loop(optimizer, kernel):
    """Five steps of two parameter groups (different learning rates, weight decay) from the same gradients."""
    cfg = TrainConfig(optimizer=optimizer, weight_decay=0.01)
    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(5), torch.randn(2, 2)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    finals = []
    for k in ("loop", kernel):
        params = [nn.Parameter(p.clone()) for p in start]
        opt = make_optimizer(cfg, [{"params": params[:2], "lr": 0.01}, {"params": params[2:], "lr": 0.003}], k)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        finals.append(params)
    for ours, ref in zip(*finals):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


# -- the frozen backbone in the compute dtype ---------------------------------------------------------------------
def test_bf16_stores_the_frozen_backbone_in_bf16_and_trains_in_fp32():
    """After a bf16 round: every frozen parameter is bf16 and shared by the cohort's views (no copy); adapters,
    their optimizer state, messages and the server state are fp32; an fp32 run keeps every tensor fp32."""
    sim = lm_simulation("train.dtype=bf16", "run.cohort=2", "run.rounds=1", "method.name=florg")
    sim.run()
    frozen = sim.model.frozen_parameters()
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in sim.model.own_parameters()} == {torch.float32}
    assert {t.dtype for t in sim.server.tensors().values()} == {torch.float32}
    view = sim._cohort.views(1)[0]
    assert [p.data_ptr() for p in view.frozen_parameters()] == [p.data_ptr() for p in frozen]
    for name, module in sim.model.adapters().items():  # FLoRG's bases: bf16, one copy for every view
        assert module.L.dtype == torch.bfloat16 and module.L.data_ptr() == view.target(name).L.data_ptr()
    run = fit_run(lm_simulation("train.dtype=bf16"))
    store_frozen(run.model, "bf16")
    train_step(run)()
    assert {s.dtype for state in run.opt.state.values() for s in state.values() if s.is_floating_point()} \
        == {torch.float32}
    fp32 = lm_simulation("run.rounds=1")
    fp32.run()
    assert {p.dtype for p in fp32.model.net.parameters()} == {torch.float32}
    assert not any(m._forward_pre_hooks for m in fp32.model.net.modules())


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bert"])
def test_a_bf16_backbone_step_matches_autocast(model):
    """One step's loss and adapter gradients over a bf16-stored backbone equal those of the fp32 backbone under
    bf16 autocast (the previous way) to bf16's precision."""
    from helpers import tiny_config, tiny_task

    sim = lm_simulation() if model == "tiny-llama" else Simulation(tiny_config(), task=tiny_task())
    sim.method.load_global(sim.model, sim.server)
    torch.manual_seed(0)
    for m in sim.model.adapters().values():  # B ≠ 0, so that both factors get a gradient
        m.set_factors(m.lora_A, 0.1 * torch.randn_like(m.lora_B))
    params = sim.method.trainable(sim.model, ("A", "B"))
    sim.model.set_trainable(params)
    batch = sim.task.batch(sim.parts[0][:4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = sim.task.loss(sim.model.net, batch)
    ref_grads = torch.autograd.grad(ref, list(params.values()))
    store_frozen(sim.model, "bf16")
    loss = sim.task.loss(sim.model.net, batch)
    grads = torch.autograd.grad(loss, list(params.values()))
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(float(ref.detach()), rel=2e-2)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32
        assert float(F.cosine_similarity(g.flatten(), r.flatten(), dim=0)) > 0.99


def test_a_bf16_run_exports_its_fp32_model(tmp_path):
    """Export rebuilds the global model without training, so the backbone stays as loaded (fp32) beside the
    pristine one: the exported adapter scores what the run's global model scores in fp32."""
    from fedlowrank.export import export_run

    run_dir = tmp_path / "run"
    Simulation(load_config("tiny-lm", ["task.options.eval_generate=0", "train.dtype=bf16", "run.rounds=1",
                                       "train.lr=0.05"]), task=lm_task(), run_dir=run_dir).run()
    report = export_run(run_dir, tmp_path / "adapter", task=lm_task())
    assert report["check"]["exported"]["loss"] == pytest.approx(report["check"]["run"]["loss"], rel=1e-5)


# -- the new settings -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    ("task.length_buckets=[64, 32]", "task.length_buckets must be increasing, got [64, 32]"),
    ("task.length_buckets=[64, 1024]", "task.length_buckets must lie in [2, task.max_length = 768], got [64, 1024]"),
    ("task.length_buckets=[64.5]", "task.length_buckets[0] must be an integer, got 64.5"),
    ("task.length_buckets=[1]", "task.length_buckets[0] must be >= 2"),
    ("run.gpu_memory_fraction=0", "run.gpu_memory_fraction must be in (0, 1], got 0.0"),
    ("run.gpu_memory_fraction=1.5", "run.gpu_memory_fraction must be in (0, 1], got 1.5"),
    ("run.compile=1", "run.compile must be one of auto, true, false; got '1'"),
    ("train.gradient_checkpointing='yes'", "train.gradient_checkpointing must be one of auto, true, false; "
                                           "got 'yes'"),
])
def test_bad_gpu_settings_are_named(setting, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny-lm", [setting])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_execution_settings_keep_a_checkpoint_valid():
    """Compiling, padding to buckets, checkpointing activations and the memory share change no maths: a run may
    resume with other values (and runs made before these settings existed keep their fingerprint)."""
    from fedlowrank.runtime.checkpoint import config_fingerprint

    base = config_fingerprint(load_config("tiny-lm"))
    other = load_config("tiny-lm", ["run.compile=true", "task.length_buckets=[64, 128]", "run.gpu_memory_fraction=0.5",
                                    "train.gradient_checkpointing=true"])
    assert config_fingerprint(other) == base
    assert config_fingerprint(load_config("tiny-lm", ["train.dtype=bf16"])) != base


# -- length buckets -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("longest, buckets, expected", [(37, [], 37), (37, [32, 64, 128], 64), (64, [32, 64], 64),
                                                        (200, [32, 64], 768), (768, [32], 768)])
def test_padded_length(longest, buckets, expected):
    assert padded_length(longest, buckets, 768) == expected


@pytest.mark.parametrize("config", ["tiny-lm", "tiny"])
def test_bucketed_batches_have_few_shapes_and_the_same_loss(config):
    """Every training batch of a round has one of the buckets' widths (here 2: each compiles once), and padding
    further changes no loss."""
    buckets = [256, 512] if config == "tiny-lm" else [8, 12]
    plain = build_task(load_config(config)) if config == "tiny" else lm_task()
    bucketed = build_task(load_config(config, [f"task.length_buckets={buckets}"]))
    net = plain.build_model().net
    widths = set()
    for start in range(0, 40, 4):
        indices = np.arange(start, start + 4)
        batch, padded = plain.batch(indices), bucketed.batch(indices)
        widths.add(padded["input_ids"].shape[1])
        assert padded["input_ids"].shape[1] >= batch["input_ids"].shape[1]
        torch.testing.assert_close(bucketed.loss(net, padded), plain.loss(net, batch), rtol=1e-5, atol=1e-6)
    assert widths <= {*buckets, bucketed.max_length} and len(widths) <= 3


# -- run.compile ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fast_compile(monkeypatch):
    """torch.compile with the ``aot_eager`` backend (traced graphs, no code generation: seconds, not minutes);
    dynamo's caches and counters reset before and after."""
    import torch._dynamo

    monkeypatch.setattr(compiling, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.mark.parametrize("cohort", [1, 2])
def test_a_compiled_run_equals_eager_and_compiles_each_bucket_once(cohort, fast_compile):
    """Two rounds of two clients (one at a time, or one cohort) with two length buckets: at most one graph per
    bucket for the whole run (every client and round replays it), and the eager run's global model."""
    sets = ["task.options.eval_generate=0", "task.length_buckets=[512, 768]", f"run.cohort={cohort}",
            "run.clients_per_round=2"]
    task = build_task(load_config("tiny-lm", sets))
    compiled = Simulation(load_config("tiny-lm", ["run.compile=true", *sets]), task=task)
    compiled.run()
    assert 1 <= fast_compile["stats"]["unique_graphs"] <= 2
    eager = Simulation(load_config("tiny-lm", sets), task=task)
    eager.run()
    for key, value in eager.server.tensors().items():
        torch.testing.assert_close(compiled.server[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_a_run_that_cannot_compile_goes_on_eagerly(fast_compile, monkeypatch, caplog):
    def broken(graph, inputs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(compiling, "COMPILE_BACKEND", broken)
    compiled = lm_simulation("run.compile=true", "run.rounds=1")
    with caplog.at_level("WARNING", logger="fedlowrank"):
        compiled.run()
    lines = [r.getMessage() for r in caplog.records if "run.compile" in r.getMessage()]
    assert len(lines) == 1 and "no C++ compiler here" in lines[0] and "\n" not in lines[0]
    eager = lm_simulation("run.rounds=1")
    eager.run()
    for key, value in eager.server.tensors().items():
        torch.testing.assert_close(compiled.server[key], value, rtol=0, atol=0, msg=key)


# -- gradient checkpointing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cohort", [1, 2])
def test_gradient_checkpointing_gives_the_same_run_with_less_memory(cohort):
    """Layers recomputed during backward (inside the cohort's routing, so each member's adapters are recomputed
    with its own factors): the same global model; a step's peak memory drops."""
    sets = [f"run.cohort={cohort}", "run.clients_per_round=2", "run.rounds=1"]
    plain = lm_simulation(*sets)
    plain.run()
    checkpointed = lm_simulation("train.gradient_checkpointing=true", *sets)
    checkpointed.run()
    assert checkpointed.model.net.is_activation_checkpointing
    for key, value in plain.server.tensors().items():
        torch.testing.assert_close(checkpointed.server[key], value, rtol=1e-5, atol=1e-7, msg=key)
    peaks = []
    for sim in (plain, checkpointed):
        run = fit_run(sim)
        batch = sim.task.batch(np.arange(8))
        run.batches = iter([batch] * 2)
        step = train_step(run)
        step()
        peaks.append(measured_peak_bytes(step, torch.device("cpu")))
    assert peaks[1] < 0.8 * peaks[0], peaks


def test_gradient_checkpointing_needs_a_model_that_supports_it():
    cfg = load_config("matrix", ["task.options={num_clients = 2, dim = 6, outputs = 3, samples = 8}",
                                 "partition.num_clients=2", "run.clients_per_round=2",
                                 "train.gradient_checkpointing=true"])
    with pytest.raises(ValueError, match=r"^train.gradient_checkpointing: the model \(\w+\) does not support it"):
        Simulation(cfg).run()


# -- the cohort memory planner ----------------------------------------------------------------------------------------
def joint_fit_of(sim: Simulation, size: int, batch, cohort: Cohort | None = None) -> LocalSteps:
    """The joint steps of ``size`` FedIT members on ``sim``'s model whose every step trains on ``batch``."""
    models = cohort.views(size) if cohort is not None else [sim.model.shared_copy() for _ in range(size)]
    fit = joint_steps(sim, [fit_run(sim, k, models[k]) for k in range(size)], cohort)
    for member in fit.members:
        member.batches = iter([batch] * 3)
    return fit


def smollm2_with_layers(tmp_path_factory, layers: int) -> str:
    """A folder holding SmolLM2-135M's architecture cut to ``layers`` layers (random weights) with SmolLM2's
    tokenizer."""
    from transformers import LlamaForCausalLM

    from fedlowrank.models.architectures import ARCHITECTURES, architecture_config
    from fedlowrank.models.bundled import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    config = architecture_config(ARCHITECTURES["smollm2-135m"], tokenizer)
    config.num_hidden_layers = layers
    folder = tmp_path_factory.mktemp(f"smollm2-{layers}l")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def smollm2_two_layers(tmp_path_factory) -> str:
    return smollm2_with_layers(tmp_path_factory, 2)


MEMORY_GRID = [(model, sets) for model in ("tiny-llama", "smollm2-2l") for sets in (
    [], ["train.dtype=bf16"], ["train.gradient_checkpointing=true"], ["task.options.pack=1024"])
    if not (model == "smollm2-2l" and sets == ["train.dtype=bf16"])]  # bf16 matmuls: minutes on a CPU


@pytest.mark.parametrize("model, sets", MEMORY_GRID, ids=[f"{m}-{'-'.join(s) or 'fp32'}" for m, s in MEMORY_GRID])
def test_the_cohort_memory_estimate_is_within_15_percent_of_the_measured_peak(model, sets, monkeypatch, request):
    """The planner's estimate of a joint step (two probe steps) against the bytes a joint step of 1 and 4 members
    allocates at its peak (the longest examples for every member; CPU allocator events), on tiny-llama and a
    2-layer SmolLM2 (49,152-token vocabulary, its logits chunk cut to 40 positions here so that a joint batch of 4
    rows fills it: the estimate holds from the probe's rows on; fp32 only: bf16 matmuls take minutes on a CPU)."""
    from fedlowrank.tasks import causal_lm

    if model == "smollm2-2l":
        monkeypatch.setattr(causal_lm, "LOGITS_CHUNK_ELEMENTS", 49152 * 40)
        model = request.getfixturevalue("smollm2_two_layers")
    cfg = load_config("tiny-lm", ["task.options.eval_generate=0", f"task.model={model}", "run.clients_per_round=4",
                                  "train.gradient_checkpointing=false", *sets])
    sim = Simulation(cfg, task=build_task(cfg))
    memory = cohort_memory(sim.cfg, sim.task, sim.model)
    longest = np.argsort([-len(e.ids) for e in sim.task.train], kind="stable")[:sim.cfg.train.batch_size]
    rows = sim.task.probe_rows(4 * sim.task.rows_per_step(sim.cfg.train.batch_size))
    for size in (1, 4):
        if rows > 1 and size * sim.task.rows_per_step(sim.cfg.train.batch_size) < rows:
            continue
        fit = joint_fit_of(sim, size, sim.task.batch(longest))
        fit.step(0)
        measured = measured_peak_bytes(lambda: fit.step(1), torch.device("cpu"))
        assert 0.85 * measured <= memory.step(size) <= 1.15 * measured, (size, memory.step(size), measured)


def test_what_a_device_allocates_once_is_held_not_a_step_cost(monkeypatch):
    """A device that allocates a buffer at its first step and keeps it (cuBLAS's workspaces on CUDA, simulated on
    the CPU): the estimate's step bytes equal those of a device that does not (an unmeasured probe runs first),
    and the buffer counts once, in what the device already holds."""
    sim = lm_simulation("run.clients_per_round=4", IID)
    plain = cohort_memory(sim.cfg, sim.task, sim.model)
    workspace, measured = 2**20, planner.measured_bytes
    kept = []

    def first_step_allocates(fn, device):
        peak, held = measured(fn, device)
        if not kept:
            kept.append(workspace)
            return peak + workspace, held + workspace
        return peak, held

    monkeypatch.setattr(planner, "measured_bytes", first_step_allocates)
    model_bytes = planner.weight_bytes(sim.model.net) + plain.own
    monkeypatch.setattr(planner, "allocated_bytes", lambda device: model_bytes + sum(kept))
    once = cohort_memory(sim.cfg, sim.task, sim.model)
    assert plain.held == 0 and once.held == workspace
    for k in (1, 4):
        assert once.step(k) == pytest.approx(plain.step(k), rel=0.02)
        assert once.peak(k) - plain.peak(k) == pytest.approx(workspace, rel=0.05)


@pytest.fixture(scope="module")
def smollm2_four_layers(tmp_path_factory) -> str:
    return smollm2_with_layers(tmp_path_factory, 4)


@pytest.mark.parametrize("sets", [[], ["train.gradient_checkpointing=true"]], ids=["plain", "checkpointing"])
def test_the_per_layer_estimate_equals_a_probe_of_the_whole_depth(sets, monkeypatch, smollm2_four_layers):
    """The planner probes a deep decoder cut to 1 and 2 layers and extrapolates per layer: on a 4-layer SmolLM2
    (its logits chunk cut as above) its estimate of a joint step of 1 and 4 members is within 15 % (the memory
    model's tolerance; measured: equal) of the estimate from probes of all 4 layers; the model is left whole."""
    from fedlowrank.tasks import causal_lm

    monkeypatch.setattr(causal_lm, "LOGITS_CHUNK_ELEMENTS", 49152 * 40)
    cfg = load_config("tiny-lm", ["task.options.eval_generate=0", f"task.model={smollm2_four_layers}",
                                  "run.clients_per_round=4", "train.gradient_checkpointing=false", *sets])
    sim = Simulation(cfg, task=build_task(cfg))
    assert planner.stacked_layers(sim.model.net) is not None
    assert planner.stacked_layers(lm_simulation().model.net) is None  # tiny-llama: 2 layers, probed whole
    layered, whole = (cohort_memory(sim.cfg, sim.task, sim.model, per_layer=on) for on in (True, False))
    assert len(sim.model.net.get_decoder().layers) == sim.model.net.config.num_hidden_layers == 4
    for size in (1, 4):
        assert 0.85 * whole.step(size) <= layered.step(size) <= 1.15 * whole.step(size), (size, layered, whole)


def test_a_cohorts_lora_factors_are_views_of_stacked_tensors_that_persist_across_fits():
    """A joint step's LoRA factors: every member's ``lora_A`` (``lora_B``) of every target is a view of one stacked
    tensor per factor group (every target's A of one input size, every B of one output size), whose one gradient
    holds each member's, equal to the member's own step alone (different factors per member); the next fit of the
    cohort (the next round) writes into the same tensors and restarts the same optimizer."""
    sim = lm_simulation("run.clients_per_round=4")
    batch = sim.task.batch(np.arange(4))
    cohort = Cohort(sim.model, 3)
    fit = joint_fit_of(sim, 3, batch, cohort)
    stacks = cohort.stacks
    shapes = [sim.model.base_matrix(n).shape for n in sim.model.target_names]
    assert set(stacks.groups) == {("A", i) for _, i in shapes} | {("B", o) for o, _ in shapes}
    assert len(stacks.groups) < len(stacks.names) == len(sim.model.target_names)
    g = torch.Generator().manual_seed(0)
    factors = []
    for run in fit.members:
        mine = {}
        for name, layer in run.model.adapters().items():
            A, B = torch.randn(layer.lora_A.shape, generator=g), torch.randn(layer.lora_B.shape, generator=g) / 10
            layer.set_factors(A, B)
            mine[name] = (A, B)
        factors.append(mine)
    fit.step(0)
    storages = {key: group.untyped_storage().data_ptr() for key, group in stacks.groups.items()}
    for run in fit.members:
        for layer in run.model.adapters().values():
            assert {layer.lora_A.untyped_storage().data_ptr(), layer.lora_B.untyped_storage().data_ptr()} <= \
                set(storages.values())
            assert layer.lora_A.grad is None and layer.lora_B.grad is None  # FedIT: no gradient handed out
    for k, run in enumerate(fit.members):
        alone = fit_run(sim, k, sim.model.shared_copy())
        for layer_name, layer in alone.model.adapters().items():
            layer.set_factors(*factors[k][layer_name])
        alone.batches = iter([batch] * 2)
        train_step(alone)()
        for key, p in run.params.items():
            name, factor = key.rsplit(".lora_", 1)
            grad = stacks.member_grad(name, k, factor, p.shape[0 if factor == "A" else 1])
            torch.testing.assert_close(grad, alone.params[key].grad, rtol=1e-6, atol=1e-7, msg=key)
            torch.testing.assert_close(p.detach(), alone.params[key].detach(), rtol=1e-6, atol=1e-7, msg=key)
    fit.finish()
    opt = fit.group.opt
    again = joint_fit_of(sim, 3, batch, cohort)
    assert again.group.opt is opt and {k: g.untyped_storage().data_ptr() for k, g in stacks.groups.items()} == storages
    assert all(v.abs().max() == 0 for s in opt.state.values() for v in s.values())  # restarted: a new optimizer's


def test_the_automatic_cohort_on_cuda_is_the_largest_that_fits(monkeypatch, caplog):
    """``run.cohort = 0`` on CUDA: the largest cohort whose estimated peak fits ``run.gpu_memory_fraction`` of the
    free memory (the device's memory is simulated here; the estimate is the CPU's)."""
    sim = lm_simulation("run.clients_per_round=4", "train.gradient_checkpointing=false", IID)
    memory = cohort_memory(sim.cfg, sim.task, sim.model)
    free = (memory.peak(2) + memory.peak(3)) / 2 / 0.9  # 0.9 of it holds 2 members, not 3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free), 2 * int(free)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    cuda = torch.device("cuda")
    with caplog.at_level("INFO", logger="fedlowrank"):
        assert cohort_size(sim.cfg, sim.method, sim.task, sim.model, cuda) == (2, "", False)
    assert [r.getMessage() for r in caplog.records][-1].startswith("run.cohort = 0: 2 of 4 clients train together")
    tight = load_config("tiny-lm", ["task.options.eval_generate=0", "run.clients_per_round=4",
                                    "run.gpu_memory_fraction=0.3", "train.gradient_checkpointing=false"])
    assert cohort_size(tight, sim.method, sim.task, sim.model, cuda) == (1, "", False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * int(free), 200 * int(free)))
    assert cohort_size(sim.cfg, sim.method, sim.task, sim.model, cuda) == (4, "", False)  # at most the round's
    explicit = load_config("tiny-lm", ["task.options.eval_generate=0", "run.clients_per_round=4", "run.cohort=3",
                                       "train.gradient_checkpointing=false"])
    assert cohort_size(explicit, sim.method, sim.task, sim.model, cuda) == (3, "", False)  # run.cohort > 0 obeyed


def test_the_automatic_cohort_turns_checkpointing_on_when_that_fits_more_clients(monkeypatch, caplog):
    """``train.gradient_checkpointing = "auto"`` (the default) with ``run.cohort = 0`` on CUDA: checkpointing is
    switched on exactly when it lets a larger cohort fit (simulated device memory; CPU estimates)."""
    sim = lm_simulation("run.clients_per_round=4")
    assert sim.cfg.train.gradient_checkpointing == "auto"
    plain, checkpointed = (cohort_memory(sim.cfg, sim.task, sim.model, on) for on in (False, True))
    assert checkpointed.step(4) < 0.8 * plain.step(4) and not sim.model.net.is_activation_checkpointing
    assert plain.peak(1) < checkpointed.peak(4) < plain.peak(4)
    free = checkpointed.peak(4) / 0.9 * 1.01  # 4 members fit with checkpointing only
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free), 2 * int(free)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    cuda = torch.device("cuda")
    with caplog.at_level("INFO", logger="fedlowrank"):
        assert cohort_size(sim.cfg, sim.method, sim.task, sim.model, cuda) == (4, "", True)
    assert caplog.records[-1].getMessage().endswith("gradient checkpointing on (auto))")
    off = load_config("tiny-lm", ["task.options.eval_generate=0", "run.clients_per_round=4",
                                  "train.gradient_checkpointing=false"])
    assert cohort_size(off, sim.method, sim.task, sim.model, cuda)[0] < 4      # false: never switched on
    assert not sim.model.net.is_activation_checkpointing                          # the planner changes no model
    fixed = load_config("tiny-lm", ["task.options.eval_generate=0", "run.clients_per_round=4", "run.cohort=4"])
    with caplog.at_level("INFO", logger="fedlowrank"):
        assert cohort_size(fixed, sim.method, sim.task, sim.model, cuda) == (4, "", True)  # a fixed cohort: on
    assert caplog.records[-1].getMessage().startswith("run.cohort = 4: gradient checkpointing on (auto)")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * int(free), 200 * int(free)))
    assert cohort_size(sim.cfg, sim.method, sim.task, sim.model, cuda) == (4, "", False)  # all fit without: off
    assert cohort_size(fixed, sim.method, sim.task, sim.model, cuda) == (4, "", False)


def llama_1b_with_two_built_layers(monkeypatch, *sets: str):
    """The GSM8K causal-LM task of the 1B GPU target (``arch:llama-3.2-1b`` with SmolLM2's tokenizer, 32 clients
    × batches of 4, LoRA on q and v) and its model with LoRA attached, where only the embeddings, the final norm and
    the first 2 of the 16 decoder layers are built (random weights); layers 3..16 are on the ``meta`` device: never
    allocated, never run (the planner probes the decoder cut to 1 and 2 layers)."""
    import dataclasses

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fedlowrank.adapters.lora import LoRALinear
    from fedlowrank.models import architectures

    require_dataset("gsm8k")
    arch = architectures.ARCHITECTURES["llama-3.2-1b"]
    monkeypatch.setitem(architectures.ARCHITECTURES, "llama-3.2-1b",
                        dataclasses.replace(arch, params={**arch.params, "num_hidden_layers": 2}))
    cfg = load_config("gsm8k", ["task.model=arch:llama-3.2-1b@smollm2-135m", "partition.kind=iid",
                                "partition.num_clients=32", "run.clients_per_round=32", "train.batch_size=4",
                                "train.local_steps=5", "run.cohort=0", "task.options.eval_generate=0", *sets])
    task = build_task(cfg)
    net = task.loaded.net
    with torch.device("meta"):
        net.model.layers.extend(LlamaDecoderLayer(net.config, i) for i in range(2, 16))
    net.config.num_hidden_layers = 16
    assert sum(p.numel() for p in net.parameters()) == arch.parameters  # the released model's 1,235,814,400
    model = task.build_model()
    model.attach(lambda name, lin: LoRALinear(lin, cfg.lora.rank, cfg.lora.alpha, cfg.lora.scaling))
    return cfg, task, model


@pytest.mark.slow
def test_the_planner_fits_32_clients_of_the_1b_architecture_in_80_gib_by_checkpointing(monkeypatch, caplog):
    """The 1B GPU target on a faked 80 GiB of free CUDA memory: the automatic cohort (``run.cohort = 0``,
    ``train.gradient_checkpointing = "auto"``) of the Llama-3.2-1B architecture's 32 clients on GSM8K holds all 32 by
    turning gradient checkpointing on; without checkpointing they do not fit. Probes on the CPU, per layer
    (:func:`~fedlowrank.runtime.cohort.cut_decoder`), in fp32 (bf16 matmuls take many minutes on a CPU; bf16 halves
    both the weights and the activations, so the verdict is the same)."""
    cfg, task, model = llama_1b_with_two_built_layers(monkeypatch)
    estimates = {}
    monkeypatch.setattr(planner, "cohort_memory", lambda cfg, task, model, on: estimates.setdefault(
        on, cohort_memory(cfg, task, model, on)))
    free = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    with caplog.at_level("INFO", logger="fedlowrank"):
        size, checkpointing = planner.largest_fitting_cohort(cfg, task, model, torch.device("cuda"), 32)
    budget = cfg.run.gpu_memory_fraction * free
    peaks = {on: f"{m.peak(32) / 2**30:.1f} GiB" for on, m in estimates.items()}
    assert size == 32 and checkpointing, (caplog.records[-1].getMessage(), peaks)
    assert estimates[False].peak(32) > budget and estimates[True].peak(32) <= budget, peaks
    assert caplog.records[-1].getMessage().startswith("run.cohort = 0: 32 of 32 clients train together")


# -- packing ------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def packed_task():
    """The ``tiny-lm`` task packing each step into rows of 1536 tokens (twice task.max_length)."""
    return build_task(load_config("tiny-lm", ["task.options.eval_generate=0", "task.options.pack=1536"]))


def test_a_packed_batch_gives_the_padded_loss_and_gradient():
    """The same examples packed in one row (positions restarting at each example, no mask) or padded one per row:
    attention stays within each example, so the loss and the adapters' gradient agree."""
    packed, padded = packed_task(), lm_task()
    net = padded.build_model().net
    trained = [p for n, p in net.named_parameters() if "self_attn" in n]
    for p in trained:
        p.requires_grad_(True)
    batch, reference = packed.batch(np.arange(4)), padded.batch(np.arange(4))
    assert "attention_mask" not in batch and batch["input_ids"].numel() < reference["input_ids"].numel()
    results = []
    for task, b in ((packed, batch), (padded, reference)):
        loss = task.loss(net, b)
        results.append((loss.detach(), torch.autograd.grad(loss, trained)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=0)
    for ours, ref in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)


def test_pack_rows_holds_every_item_once_within_the_capacity_with_little_padding():
    """Examples of lengths spread like GSM8K's byte-token ones (80 to 700 tokens): one client's 4 examples and a
    cohort's 8 × 4, packed into rows of 1536, are < 10 % padding, against > 20 % padded one example per row (to the
    longest)."""
    lengths = [int(n) for n in np.random.default_rng(1).integers(80, 700, size=400)]
    rng = np.random.default_rng(0)
    for clients in (1, 8):
        real = packed = padded = 0
        for _ in range(20):
            items = [lengths[i] for i in rng.choice(len(lengths), 4 * clients, replace=False)]
            rows = pack_rows(items, 1536)
            assert sorted(i for row in rows for i in row) == list(range(len(items)))
            fills = [sum(items[i] for i in row) for row in rows]
            assert max(fills) <= 1536
            real, packed, padded = real + sum(items), packed + len(rows) * max(fills), padded + len(items) * max(items)
        assert 1 - real / packed < 0.10 and 1 - real / padded > 0.20, (clients, real, packed, padded)


@pytest.mark.parametrize("method, sets", [("fedit", []), ("hetlora", ["lora.ranks=[1,2,2,1]"]),
                                          ("florg", []), ("fedex-lora", [])])
def test_a_packed_cohort_equals_packed_clients_one_at_a_time(method, sets):
    """A cohort's examples packed together, rows mixing members, each token routed to its member's adapters (the
    batched product, padded factors for mixed ranks, each member alone for Gram adapters and base deltas)."""
    task = packed_task()
    runs = []
    for cohort in (1, 4):
        sim = Simulation(load_config("tiny-lm", ["task.options.eval_generate=0", "task.options.pack=1536",
                                                 f"method.name={method}", "run.clients_per_round=4",
                                                 f"run.cohort={cohort}", *sets]), task=task)
        sim.run()
        runs.append(sim)
    assert runs[1].cohort_size() == 4
    for key, value in runs[0].server.tensors().items():
        if key.endswith(".gram_A"):
            value, other = (a.double().T @ a.double() for a in (value, runs[1].server[key]))
        else:
            other = runs[1].server[key]
        torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-6, msg=key)


def test_packing_refusals_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^task.options.pack with privacy.dpsgd: DP-SGD clips each example"):
        load_config("tiny-lm", ["task.options.pack=1536", "privacy.dpsgd=true"])
    with pytest.raises(ValueError, match=r"^task.options.pack must be 0 or at least task.max_length = 768"):
        build_task(load_config("tiny-lm", ["task.options.pack=512"]))
    with pytest.raises(ValueError, match=r"^task.options.pack: a packed row holds several examples"):
        packed_task().features(packed_task().build_model().net, packed_task().batch(np.arange(2)))
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)  # packing unseen
    with pytest.raises(ValueError, match=r"^task.model = 'tiny-llama': its attention does not keep sequences"):
        check_packing(lm_task().loaded.net, "tiny-llama")


# -- on CUDA (skipped without it) -------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_on_cuda_the_planned_cohort_peak_is_within_25_percent_of_the_measured_one():
    """bf16, packed GSM8K rows, the automatic cohort: the planner's peak against CUDA's allocator statistics over
    the training of a round (the model's own tensors included)."""
    sets = ["task.options.eval_generate=0", "task.options.pack=1536", "train.dtype=bf16", "run.device=cuda",
            "run.cohort=0", "run.clients_per_round=4", "run.rounds=2", IID]
    sim = Simulation(load_config("tiny-lm", sets), task=packed_task())
    assert sim.cohort_size() >= 2
    memory = cohort_memory(sim.cfg, sim.task, sim.model)
    sim.run_round()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    sim.run_round()
    measured = torch.cuda.max_memory_allocated()
    assert 0.75 * measured <= memory.peak(sim.cohort_size()) <= 1.25 * measured
    assert {p.dtype for p in sim.model.frozen_parameters()} == {torch.bfloat16}


@needs_cuda
def test_on_cuda_a_compiled_run_with_cuda_graphs_equals_eager():
    """inductor with CUDA graphs (mode reduce-overhead, two length buckets): the eager run's global model, and at
    most one graph per bucket. bf16 kernels that fuse differently round differently, so each tensor is compared
    within 5 % of its own largest entry (bf16 against fp32 differs by up to 19 % of it, on the CPU)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    sets = ["task.options.eval_generate=0", "task.length_buckets=[512, 768]", "run.device=cuda", "train.dtype=bf16",
            "run.cohort=1", "run.clients_per_round=2", IID]
    task = build_task(load_config("tiny-lm", sets))
    compiled = Simulation(load_config("tiny-lm", ["run.compile=true", *sets]), task=task)
    compiled.run()
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    eager = Simulation(load_config("tiny-lm", sets), task=task)
    eager.run()
    for key, value in eager.server.tensors().items():
        scale = value.abs().max().item()
        torch.testing.assert_close(compiled.server[key], value, rtol=2e-2, atol=5e-2 * scale,
                                   msg=lambda detail, key=key: f"{key}: {detail}")
    torch._dynamo.reset()
