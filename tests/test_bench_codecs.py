"""benchmarks/study_codecs.py: the trade study's definition (its grid is the issue's, every run a valid config, the
targets' verdicts) and its smoke run (tiny BERT; measures nothing)."""

import json

import pytest
from helpers import benchmark_module


@pytest.fixture(scope="module")
def study():
    return benchmark_module("study_codecs")


def test_the_grid_is_the_protocols_and_every_run_of_it_is_a_valid_config(study):
    assert set(study.METHODS) == {"fedit", "ffa-lora", "florg", "ssf", "ilora", "fedrpca", "fedsvd"}
    assert list(study.CODECS) == ["fp32", "bf16", "int8", "int4", "int4+ef", "topk10+ef"]
    assert study.TARGETS == {"int8": (0.27, 0.5), "int4+ef": (0.15, 1.0), "topk10+ef": (0.2, 1.0)}
    study.check_grid("main", list(study.METHODS), list(study.CODECS), [])  # raises on a refused setting
    with pytest.raises(SystemExit, match="--codecs must list fp32"):
        study.parse_args(["--out", "x", "--codecs", "int8"])


def _result(method: str, finals: list[float], up: list[int]) -> dict:
    runs = [{"seed": s, "final": f, "bytes_up": b, "bytes_down": 100} for s, (f, b) in enumerate(zip(finals, up))]
    return {"metric": "accuracy", "rows": [{"method": method, "runs": runs}]}


def test_a_target_is_met_only_when_the_paired_interval_allows_it(study):
    histories = {c: {"fedit": [[{"round": 1, "time": {"total": 10.0, "codec": 0.1}}]]} for c in ("fp32", "int8")}
    ref = _result("fedit", [0.80, 0.82, 0.81, 0.79], [1000] * 4)
    close = _result("fedit", [0.80, 0.82, 0.809, 0.79], [260] * 4)
    far = _result("fedit", [0.70, 0.72, 0.71, 0.69], [260] * 4)
    big = _result("fedit", [0.80, 0.82, 0.81, 0.79], [300] * 4)
    verdicts = [study.study({"fp32": ref, "int8": r}, histories, ["fedit"])[1]["target"]["verdict"]
                for r in (close, far, big)]
    assert verdicts == ["met", "missed", "missed"]
    entry = study.study({"fp32": ref, "int8": close}, histories, ["fedit"])[1]
    assert entry["uplink_share"] == pytest.approx(0.26) and entry["codec_time_share"] == pytest.approx(0.01)
    assert entry["paired_diff_points"]["mean"] == pytest.approx(-0.025)


def test_the_smoke_run_writes_its_table_and_plots(study, tmp_path):
    assert study.main(["--smoke", "--out", str(tmp_path)]) == 0
    entries = json.loads((tmp_path / "study.json").read_text())["entries"]
    assert [(e["method"], e["codec"]) for e in entries] == [("fedit", "fp32"), ("fedit", "int4+ef"),
                                                            ("ssf", "fp32"), ("ssf", "int4+ef")]
    coded = [e for e in entries if e["codec"] == "int4+ef"]
    assert all(e["uplink_share"] < 0.6 and e["downlink_share"] == 1.0 and 0 < e["codec_time_share"] < 1 for e in coded)
    assert "| fedit | int4+ef |" in (tmp_path / "study.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "accuracy_vs_bytes-fedit.png").stat().st_size > 0
