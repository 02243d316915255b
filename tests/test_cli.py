import json
import subprocess
import sys

from fedlowrank.cli import main


def test_run_writes_metrics_ledger_and_config(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "tiny", "--out", str(out), "--quiet", "--set", "run.rounds=2", "--json"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and "accuracy" in rows[-1]
    assert set(rows[0]["time"]) == {"client_compute", "aggregation", "evaluation", "other", "total"}
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 4 and sum(r["up"] for r in ledger) == json.loads(capsys.readouterr().out)["bytes_up"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method"]["name"] == "fedit" and cfg["run"]["rounds"] == 2
    assert len(json.loads((out / "partition.json").read_text())["label_histograms"]) == 4
    assert (out / "partition.png").stat().st_size > 1000


def test_compare_writes_table_and_plots(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "tiny", "--methods", "fedit,fedavg-full", "--out", str(out), "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "| fedit |" in table and "| fedavg-full |" in table
    assert (out / "accuracy_vs_round.png").stat().st_size > 1000
    assert (out / "accuracy_vs_bytes.png").stat().st_size > 1000
    res = json.loads((out / "results.json").read_text())
    full, lora = (next(r for r in res["rows"] if r["method"] == m) for m in ("fedavg-full", "fedit"))
    assert full["bytes_up"] > lora["bytes_up"]


def test_methods_lists_names_papers_and_payloads(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "fedit\n" in out and "fedavg-full\n" in out and "paper:" in out and "up:" in out


def test_bad_config_exits_2_with_the_field(capsys):
    assert main(["run", "tiny", "--set", "lora.alpha=0"]) == 2
    assert "lora.alpha" in capsys.readouterr().err


def test_console_script_module_entry():
    res = subprocess.run([sys.executable, "-m", "fedlowrank", "methods"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "fedit" in res.stdout
