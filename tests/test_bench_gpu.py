"""benchmarks/bench_gpu.py in its CPU mode: one tiny round of each mode, figures written as JSON lines and Markdown."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_gpu  # noqa: E402


def test_cpu_mode_writes_a_json_line_and_a_markdown_row_per_figure(tmp_path, capsys):
    out = tmp_path / "bench"
    rows = bench_gpu.main(["--device", "cpu", "--models", "tiny-llama", "--clients", "2", "--steps", "1",
                           "--batch", "1", "--rounds", "1", "--max-length", "256", "--source", "arithmetic",
                           "--out", str(out),
                           "--set", "train.gradient_checkpointing=true"])
    printed = capsys.readouterr().out
    figures = [r["figure"] for r in rows]
    assert figures == ["tiny-llama fp32 cohort", "tiny-llama fp32 one", "tiny-llama fp32 peft"]
    lines = [json.loads(x) for x in (out / "bench_gpu.jsonl").read_text().splitlines()]
    assert [x["figure"] for x in lines] == figures
    one, cohort, peft = rows[1], rows[0], rows[2]
    assert cohort["cohort"] == 2 and one["cohort"] == 1
    # the same clients and minibatches in every mode: the same real tokens; a cohort pads to the joint width
    assert one["real_tokens_per_round"] == cohort["real_tokens_per_round"] == peft["real_tokens_per_round"] > 0
    assert cohort["padded_tokens_per_round"] >= one["padded_tokens_per_round"] == peft["padded_tokens_per_round"]
    for r in rows:
        assert r["real_tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_matmul_tflops"] > 0
        assert r["per_client_step"]["aten_ops"] > 0 and r["per_client_step"]["kernel_launches"] == 0
        est = r["memory_estimate_gib"]  # the runtime's planner for our modes, none for plain peft
        assert (est is None) == (r["mode"] == "peft")
        assert est is None or est["total"] == pytest.approx(est["resident"] + est["step"]) and est["step"] > 0
        assert r["device"] == "cpu" and "load" in r and r["seed"] == 0
    md = (out / "bench_gpu.md").read_text()
    assert md.count("| tiny-llama fp32 ") == 3 and "Targets (H100):" in md
    assert "- not checked: a CPU run" in md
    lines = bench_gpu.targets(rows)
    assert "- SmolLM2 bf16 cohort ≥ 150k real tokens/s: not measured" in lines and len(lines) == 7


def test_packed_rows_are_counted_in_every_mode(tmp_path):
    rows = bench_gpu.main(["--device", "cpu", "--models", "tiny-llama", "--clients", "2", "--steps", "1",
                           "--batch", "2", "--rounds", "1", "--max-length", "256", "--source", "arithmetic",
                           "--modes", "cohort,peft", "--no-profile", "--set", "task.options.pack=256",
                           "--out", str(tmp_path)])
    cohort, peft = rows
    assert cohort["real_tokens_per_round"] == peft["real_tokens_per_round"] > 0
    assert cohort["padded_tokens_per_round"] >= cohort["real_tokens_per_round"]


def test_event_counts_count_copies_syncs_and_graph_replays():
    from types import SimpleNamespace as E

    mm = E(name="aten::mm", cpu_parent=None)
    events = [mm, E(name="aten::_local_scalar_dense", cpu_parent=E(name="aten::item", cpu_parent=None)),
              E(name="aten::item", cpu_parent=None), E(name="cudaLaunchKernel", cpu_parent=mm),
              E(name="cudaGraphLaunch", cpu_parent=None), E(name="cudaGraphLaunch", cpu_parent=None),
              E(name="cudaStreamSynchronize", cpu_parent=None), E(name="cudaMemcpyAsync", cpu_parent=None),
              E(name="Memcpy HtoD (Pageable -> Device)", cpu_parent=None),
              E(name="Memcpy HtoD (Pinned -> Device)", cpu_parent=None),
              E(name="Memcpy DtoH (Device -> Pageable)", cpu_parent=None)]
    assert bench_gpu.event_counts(events) == {"aten_ops": 2, "host_reads": 1, "syncs": 1, "copies_h2d": 2,
                                              "pageable_h2d": 1, "kernel_launches": 1, "graph_replays": 2}


def test_a_wait_is_attributed_to_its_python_frame_else_to_its_part_of_the_round():
    from types import SimpleNamespace as E

    def chain(*names):  # innermost first
        parent = None
        for name in reversed(names):
            parent = E(name=name, cpu_parent=parent)
        return parent

    framed = chain("aten::copy_", "aten::to", "fedlowrank/runtime/engine.py(88): client_update",
                   "fedlowrank.reply_to_host")
    unframed = chain("aten::copy_", "aten::_to_copy", "aten::to", "fedlowrank.reply_to_host",
                     "fedlowrank.client_update")
    assert bench_gpu.caller(framed) == "fedlowrank/runtime/engine.py(88): client_update"
    assert bench_gpu.caller(unframed) == "fedlowrank.reply_to_host: aten::to"
    assert bench_gpu.caller(chain("fedlowrank.receive")) == "fedlowrank.receive"
    assert bench_gpu.caller(chain("aten::item", "torch/_tensor.py(10): item")) == "?"
    sync = E(name="cudaStreamSynchronize", cpu_parent=unframed)
    read = E(name="aten::_local_scalar_dense", cpu_parent=chain("aten::item", "fedlowrank.receive"))
    assert bench_gpu.waits_by_caller([sync, read, sync], 5) == [
        (2, "cudaStreamSynchronize", "fedlowrank.reply_to_host: aten::to"),
        (1, "aten::_local_scalar_dense", "fedlowrank.receive: aten::item")]


@pytest.mark.parametrize("cohort", [1, 2])
def test_a_profiled_round_holds_every_part_of_the_round_on_every_thread(cohort):
    """The parts of a round (fedlowrank.execution.measure.phase) are profiler ranges on any device, and the
    benchmark's profile sees them: one at a time, and as a cohort, whose members update in the calling thread."""
    import torch

    from fedlowrank.config import load_config
    from fedlowrank.runtime.simulator import Simulation

    sim = Simulation(load_config("tiny", ["run.rounds=1", "run.clients_per_round=2", "train.local_steps=1",
                                          "run.checkpoint_every=0", f"run.cohort={cohort}"]))
    events = bench_gpu.profiled(sim.run_round, torch.device("cpu")).events()
    counts = {}
    for e in events:
        counts[e.name] = counts.get(e.name, 0) + 1
    for part in ("client_update", "reply_to_host", "wire", "receive", "close_round", "local_step"):
        assert counts.get(f"fedlowrank.{part}", 0) >= 1, part
    assert counts["fedlowrank.client_update"] == 2 // cohort and counts["fedlowrank.reply_to_host"] == 2
    assert counts["fedlowrank.receive"] == 2 and counts["fedlowrank.local_step"] == 2 // cohort
    assert len({e.thread for e in events if e.name.startswith("fedlowrank.")}) == 1  # no thread of a member's
