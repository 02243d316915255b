"""benchmarks/gpu_check.sh in its dry mode: every step runs on the CPU with tiny models and the table is written."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_gpu_check_runs_every_step_and_writes_the_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "BUNDLE_DIR": str(tmp_path / "bundle"),
           "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    steps = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == ["cuda-tests", "smollm2-bf16-cohort", "smollm2-bf16-breakdown", "smollm2-bf16-one",
                                     "smollm2-fp32", "smollm2-compiled", "1b-cohort"]
    assert all(rc == "0" for _, rc, _ in steps), (tmp_path / "check.log").read_text()[-3000:]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| target | measured | holds? |" in md and md.count("| step ") == 7
    assert "| 1B cohort ≥ 25 % MFU | – | not measured |" in md
    lines = [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    figures = [x for x in lines if "figure" in x]
    assert {x["mode"] for x in figures} == {"cohort", "one", "peft"} and len(figures) == 6
    assert sum("target" in x for x in lines) == 7


def test_a_failing_step_is_reported_and_the_rest_goes_on(tmp_path):
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench_gpu = importlib.import_module("bench_gpu")
    (tmp_path / "steps.tsv").write_text("cuda-tests\t1\t3\nsmollm2-bf16\t124\t120\n1b-cohort\t0\t50\n")
    md = bench_gpu.report(str(tmp_path))
    assert "| step cuda-tests | **failed (exit 1)** in 3 s | **no** |" in md
    assert "| step smollm2-bf16 | **timed out** in 120 s | **no** |" in md
    assert "| step 1b-cohort | ok in 50 s | yes |" in md
