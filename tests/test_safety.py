"""Nothing lost, nothing trusted blindly: refused commands leave no trace and never turn a folder into a "run",
exports never write into a run, checkpoints restore only from verified files, killed runs' temporaries go."""

import json
import os
import subprocess
import sys

import pytest
from helpers import tiny_config, tiny_task

from fedlowrank.cli import main
from fedlowrank.runtime.simulator import Simulation


def rounds_in(run_dir, name="metrics.jsonl"):
    return [json.loads(line)["round"] for line in (run_dir / name).read_text().splitlines()]


def user_folder(tmp_path):
    folder = tmp_path / "V"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    return folder


def untouched(folder):
    return sorted(p.name for p in folder.iterdir()) == ["thesis.tex"] and \
        (folder / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize("first", [
    ["run", "tiny", "--set", "run.rounds=1"],
    ["run", "tiny", "--set", "run.rounds=1", "--overwrite"],
    ["resume"],
    ["compare", "tiny", "--methods", "fedit", "--seeds", "0"],
])
def test_a_refused_command_leaves_nothing_and_overwrite_still_refuses_a_user_folder(first, tmp_path, capsys):
    folder = user_folder(tmp_path)
    argv = [*first, str(folder)] if first == ["resume"] else [*first, "--out", str(folder)]
    assert main([*argv, "--quiet"]) == 2
    assert untouched(folder), sorted(p.name for p in folder.iterdir())
    assert main(["run", "tiny", "--overwrite", "--out", str(folder), "--quiet", "--set", "run.rounds=1"]) == 2
    assert "holds no fedlowrank run" in capsys.readouterr().err
    assert untouched(folder)


def test_a_refused_command_does_not_leave_the_directory_it_created(tmp_path, capsys, monkeypatch):
    new = tmp_path / "new"
    assert main(["compare", "tiny", "--methods", "fedit", "--seeds", "0,x", "--out", str(new), "--quiet"]) == 2
    assert not new.exists()
    parent = tmp_path / "runs"  # the default directories under run.out_dir
    assert main(["compare", "tiny", "--seeds", "0,x", "--set", f"run.out_dir={parent}", "--quiet"]) == 2
    assert main(["tune", "tiny", "--methods", "nope", "--set", f"run.out_dir={parent}", "--quiet"]) == 2

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    import fedlowrank.runtime.run as run_module

    monkeypatch.setattr(run_module, "build_task", interrupted)
    assert main(["run", "tiny", "--set", f"run.out_dir={parent}", "--quiet"]) == 130
    assert main(["run", "tiny", "--out", str(new), "--quiet"]) == 130
    assert not new.exists() and not parent.exists()  # nor the run.out_dir made for the default directory


def test_a_finished_run_keeps_no_lock_and_overwrite_still_replaces_it(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "tiny", "--out", str(out), "--quiet", "--set", "run.rounds=1"]) == 0
    assert not (out / ".lock").exists()
    assert main(["run", "tiny", "--out", str(out), "--quiet", "--set", "run.rounds=2", "--overwrite"]) == 0
    assert rounds_in(out) == [1, 2]


def test_overwrite_replaces_an_interrupted_comparison(tmp_path):
    cmp = tmp_path / "cmp"
    assert main(["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(cmp), "--quiet"]) == 0
    (cmp / "results.json").unlink()  # as if killed before the comparison ended
    (cmp / "results.md").unlink()
    assert main(["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(cmp), "--quiet",
                 "--overwrite"]) == 0
    assert (cmp / "results.json").is_file()


def test_resume_of_a_comparison_never_writes_into_a_user_folder(tmp_path, capsys):
    folder = user_folder(tmp_path)
    assert main(["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(folder), "--resume",
                 "--quiet"]) == 2
    assert "holds neither a fedlowrank compare" in capsys.readouterr().err and untouched(folder)


def test_overwrite_refuses_a_model_folder_whose_config_json_is_not_a_runs(tmp_path, capsys):
    model = tmp_path / "my-bert"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bert"}')
    (model / "model.safetensors").write_bytes(b"weights")
    assert main(["run", "tiny", "--overwrite", "--out", str(model), "--quiet", "--set", "run.rounds=1"]) == 2
    assert "holds no fedlowrank run" in capsys.readouterr().err
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]


# -- export: never into a run, never over anything without --overwrite, checked before any work ----------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-round tiny FedIT run (its checkpoint at round 2)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    Simulation(tiny_config("run.rounds=2"), task=tiny_task(), run_dir=run_dir).run()
    return run_dir


def listing(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_never_writes_into_a_run_directory(finished_run, capsys):
    before = listing(finished_run)
    link = finished_run.parent / "link-to-run"
    if not link.exists():
        link.symlink_to(finished_run)
    for out in (finished_run, finished_run / "checkpoints", finished_run / "checkpoints" / "x",
                finished_run / "mine", finished_run / "export-x" / ".." / "mine", link / "mine", link):
        assert main(["export", str(finished_run), "--format", "merged", "--out", str(out), "--overwrite"]) == 2, out
        line = capsys.readouterr().err.strip()
        assert len(line.splitlines()) == 1 and line.startswith("error: --out") and "run directory" in line, line
    assert listing(finished_run) == before
    assert main(["resume", str(finished_run), "--quiet"]) == 0  # nothing to run: the run is complete
    assert main(["export", str(finished_run), "--out", str(finished_run / "export-mine")]) == 0


def test_export_refuses_a_non_empty_out_unless_overwrite_and_replaces_only_an_export(finished_run, tmp_path,
                                                                                    capsys):
    out = tmp_path / "exp"
    assert main(["export", str(finished_run), "--out", str(out)]) == 0
    first = listing(out)
    capsys.readouterr()
    assert main(["export", str(finished_run), "--out", str(out), "--format", "merged"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: --out") and "not empty" in line and "--overwrite" in line
    assert listing(out) == first
    assert main(["export", str(finished_run), "--out", str(out), "--format", "merged", "--overwrite"]) == 0
    files = set(listing(out))
    assert "model.safetensors" in files and "adapter_model.safetensors" not in files  # nothing of the old export
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]  # no temporary folder left beside it
    folder = user_folder(tmp_path)
    assert main(["export", str(finished_run), "--out", str(folder), "--overwrite"]) == 2
    assert "holds no fedlowrank export" in capsys.readouterr().err and untouched(folder)


def test_export_checks_its_out_before_any_work(finished_run, tmp_path, capsys, monkeypatch):
    import fedlowrank.export as export

    def forbidden(*args, **kwargs):
        raise AssertionError("the run was loaded before --out was checked")

    monkeypatch.setattr(export, "load_global_simulation", forbidden)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "below"):
        assert main(["export", str(finished_run), "--out", str(out)]) == 2
        line = capsys.readouterr().err.strip()
        assert len(line.splitlines()) == 1 and line.startswith("error: --out") and str(blocker) in line, line
    assert blocker.read_text() == "x"


def test_a_failed_export_leaves_no_folder(finished_run, capsys):
    before = sorted(p.name for p in finished_run.iterdir())
    assert main(["export", str(finished_run), "--rank", "100000"]) == 2
    assert "--rank must be in" in capsys.readouterr().err
    assert sorted(p.name for p in finished_run.iterdir()) == before


# -- checkpoints: every file restored from is verified; resume says when it cuts the history -----------------------
def _walk(value, change):
    """``value`` (parsed JSON) with ``change(key, item)`` applied to every item of every object, recursively."""
    if isinstance(value, dict):
        return {k: change(k, _walk(v, change)) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, change) for v in value]
    return value


EDITS = {
    "forged accuracy": lambda k, v: 0.999 if k == "accuracy" else v,
    "history cut": lambda k, v: v[:1] if k == "history" else v,
    "round moved back": lambda k, v: v - 1 if k == "round" and isinstance(v, int) and v == 3 else v,
    "files dropped": lambda k, v: {} if k == "files" else v,
    "wrong types": lambda k, v: "x" if k in ("history", "ledger", "files", "spilled") else v,
    "ledger cut": lambda k, v: v[:2] if k == "ledger" else v,
}


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory):
    """A finished 3-round tiny run with a checkpoint every round (rounds 2 and 3 kept), and its summary."""
    run_dir = tmp_path_factory.mktemp("three") / "run"
    Simulation(tiny_config("run.rounds=3", "run.checkpoint_every=1"), task=tiny_task(), run_dir=run_dir).run()
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def _copy(run_dir, tmp_path):
    import shutil

    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_checkpoint_metadata_falls_back_like_a_damaged_tensor_file(three_rounds, tmp_path, capsys, edit):
    run_dir = _copy(three_rounds[0], tmp_path)
    newest = run_dir / "checkpoints" / "round-00003"
    for path in newest.glob("*.json"):
        text = json.dumps(_walk(json.loads(path.read_text()), EDITS[edit]))
        path.write_text(text)
    assert main(["resume", str(run_dir), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "round-00003" in err.splitlines()[0] and "using round-00002" in err.splitlines()[0], err
    assert "cut back" in err and "Traceback" not in err
    assert rounds_in(run_dir) == [1, 2, 3] and [r["round"] for r in map(
        json.loads, (run_dir / "ledger.jsonl").read_text().splitlines())] == [1, 1, 2, 2, 3, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy"] == three_rounds[1]["accuracy"] and summary["bytes_up"] == three_rounds[1]["bytes_up"]


def test_a_resume_that_cuts_the_history_says_so_and_one_that_does_not_is_silent(three_rounds, tmp_path, capsys):
    run_dir = _copy(three_rounds[0], tmp_path)
    assert main(["resume", str(run_dir), "--quiet"]) == 0  # the run is complete: nothing to cut, nothing to run
    err = capsys.readouterr().err
    assert "cut back" not in err and "warning" not in err and rounds_in(run_dir) == [1, 2, 3]
    assert main(["resume", str(run_dir), "--round", "2", "--quiet"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "cut back" in line]
    assert len(lines) == 1 and "metrics.jsonl" in lines[0] and "round 3" in lines[0] and "round 2" in lines[0]
    assert rounds_in(run_dir) == [1, 2, 3]


def _dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_resume_removes_the_temporaries_of_killed_writers_only(three_rounds, tmp_path):
    run_dir = _copy(three_rounds[0], tmp_path)
    root = run_dir / "checkpoints"
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # still writing
    dead, alive = _dead_pid(), writer.pid
    for pid in (dead, alive):
        (root / f".round-00004.tmp-{pid}").mkdir()
        (root / f".round-00004.tmp-{pid}" / "server.safetensors").write_bytes(b"half")
        (root / f".latest.tmp-{pid}").write_text("round-00004")
    try:
        Simulation.resume(run_dir, task=tiny_task()).close()
    finally:
        writer.kill()
        writer.wait()
    left = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    assert left == [f".latest.tmp-{alive}", f".round-00004.tmp-{alive}"]


@pytest.mark.parametrize("damage", ["a name outside the folder", "an unlisted record", "a renamed folder"])
def test_checkpoint_integrity_records_are_checked_field_by_field(three_rounds, tmp_path, capsys, damage):
    import shutil

    run_dir = _copy(three_rounds[0], tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "round-00002")  # the damaged checkpoint is the only one
    newest = run_dir / "checkpoints" / "round-00003"
    meta = json.loads((newest / "meta.json").read_text())
    if damage == "a name outside the folder":
        meta["files"]["../../config.json"] = {"bytes": 1, "sha256": "0" * 64}
    elif damage == "an unlisted record":
        meta["files"] = {k: v for k, v in meta["files"].items() if k.endswith(".safetensors")}
    else:
        newest = newest.rename(run_dir / "checkpoints" / "round-00002")
        (run_dir / "checkpoints" / "latest").write_text("round-00002")
    (newest / "meta.json").write_text(json.dumps(meta))
    assert main(["resume", str(run_dir), "--quiet"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: no intact checkpoint") and newest.name in line, line
    assert {"a name outside the folder": "malformed entry '../../config.json'", "an unlisted record": "does not list",
            "a renamed folder": "round 3 in the folder of round 00002"}[damage] in line
    assert rounds_in(run_dir) == [1, 2, 3]  # a refused resume cuts nothing


def _forge(folder, record=None, meta=None, server=None, clients=None):
    """Rewrite the checkpoint ``folder`` with its run.json, server and client states changed by the given functions
    and its integrity record recomputed over them (then ``meta`` changes meta.json itself): a crafted checkpoint
    whose hashes all match."""
    import hashlib

    from fedlowrank.message import State

    meta_path = folder / "meta.json"
    record_meta = json.loads(meta_path.read_text())
    for name, change, load, dump in (
            ("run.json", record, lambda b: json.loads(b), lambda v: json.dumps(v).encode()),
            ("server.safetensors", server, State.from_bytes, lambda v: v.to_bytes()),
            ("clients.safetensors", clients, State.from_bytes, lambda v: v.to_bytes())):
        if change is None:
            continue
        data = dump(change(load((folder / name).read_bytes())))
        (folder / name).write_bytes(data)
        record_meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta_path.write_text(json.dumps(meta(record_meta) if meta else record_meta))


def _without(state, word):
    from fedlowrank.message import State

    return State({k: v for k, v in state.items() if word not in k})


def _with_key(state, key):
    import torch

    from fedlowrank.message import State

    return State({**state, key: torch.zeros(2)})


def _changed(state, suffix, change):
    """``state`` with the first tensor whose key ends with ``suffix`` replaced by ``change(tensor)``."""
    from fedlowrank.message import State

    key = next(k for k in sorted(state) if k.endswith(suffix))
    return State({**state, key: change(state[key])})


def _last_row(record, **fields):
    return {**record, "history": record["history"][:-1] + [{**record["history"][-1], **fields}]}


CRAFTED = {
    "history cut, hash recomputed": dict(record=lambda r: {**r, "history": r["history"][:1]}),
    "history without times": dict(record=lambda r: {**r, "history": [{"round": x["round"]} for x in r["history"]]}),
    "meta.json with another key": dict(meta=lambda m: {**m, "note": "added"}),
    "server state without lora_A": dict(server=lambda s: _without(s, "lora_A")),
    "client key without a client": dict(clients=lambda s: _with_key(s, "lora_A")),
    # the audit's: an added entry, a cut ledger, a history value of another type, non-finite or huge values, a shape
    "server state with an added entry": dict(server=lambda s: _with_key(s, "evil.lora_A")),
    "ledger cut to one row": dict(record=lambda r: {**r, "ledger": r["ledger"][:1]}),
    "a ledger row's bytes changed": dict(record=lambda r: {**r, "ledger": [{**r["ledger"][0], "up": 1}]
                                                           + r["ledger"][1:]}),
    "accuracy of another type": dict(record=lambda r: _last_row(r, accuracy="high")),
    "bytes of another type": dict(record=lambda r: _last_row(r, bytes_up=-1)),
    "NaN in the server state": dict(server=lambda s: _changed(s, "lora_B", lambda t: t * float("nan"))),
    "3e38 in the server state": dict(server=lambda s: _changed(s, "lora_B", lambda t: t * 0 + 3e38)),
    "a server tensor of another shape": dict(server=lambda s: _changed(s, "lora_A", lambda t: t[:1].repeat(3, 1))),
    "a server tensor of another dtype": dict(server=lambda s: _changed(s, "lora_A", lambda t: t.double())),
}


@pytest.mark.parametrize("craft", sorted(CRAFTED))
def test_a_crafted_checkpoint_with_matching_hashes_falls_back_to_the_last_intact_one(three_rounds, tmp_path,
                                                                                    capsys, craft):
    run_dir = _copy(three_rounds[0], tmp_path)
    _forge(run_dir / "checkpoints" / "round-00003", **CRAFTED[craft])
    assert main(["resume", str(run_dir), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "round-00003" in err.splitlines()[0] and "using round-00002" in err.splitlines()[0], err
    assert "Traceback" not in err and "internal error" not in err
    assert rounds_in(run_dir) == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy"] == three_rounds[1]["accuracy"] and summary["bytes_up"] == three_rounds[1]["bytes_up"]


@pytest.mark.parametrize("craft", ["server state with an added entry", "NaN in the server state",
                                   "3e38 in the server state", "accuracy of another type"])
def test_export_of_a_crafted_checkpoint_exports_the_last_intact_one(three_rounds, tmp_path, capsys, craft):
    """``export`` reads the checkpoint ``resume`` would: a damaged newest one is skipped with one line, and the model
    exported is the last intact one's (never a non-finite or forged one)."""
    run_dir = _copy(three_rounds[0], tmp_path)
    _forge(run_dir / "checkpoints" / "round-00003", **CRAFTED[craft])
    assert main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    err = capsys.readouterr().err
    assert "round-00003" in err and "using round-00002" in err and "Traceback" not in err, err
    assert json.loads((tmp_path / "export" / "export.json").read_text())["round"] == 2


@pytest.fixture(scope="module")
def fedalt_rounds(tmp_path_factory):
    """A finished 3-round tiny FedALT run (personalised: client states of own factors, routers and heads) with a
    checkpoint every round (rounds 2 and 3 kept)."""
    run_dir = tmp_path_factory.mktemp("fedalt") / "run"
    Simulation(tiny_config("method.name=fedalt", "run.rounds=3", "run.checkpoint_every=1"), task=tiny_task(),
               run_dir=run_dir).run()
    return run_dir


def _client_entry(clients, suffix, change=None):
    """The flat client states with the first entry of a client ending with ``suffix`` removed (``change=None``) or
    replaced by ``change(value)``."""
    from fedlowrank.message import State

    key = next(k for k in sorted(clients) if k.endswith(suffix))
    out = {k: v for k, v in clients.items() if k != key}
    if change is not None:
        out[key] = change(clients[key])
    return State(out)


CLIENT_CRAFTED = {
    "a client's lora_A missing": lambda c: _client_entry(c, "lora_A"),
    "a client's router missing": lambda c: _client_entry(c, "router"),
    "a client's index missing": lambda c: _client_entry(c, "/client"),
    "a client's tensor of another shape": lambda c: _client_entry(c, "lora_B", lambda t: t[:, :1]),
    "NaN in a client's state": lambda c: _client_entry(c, "router", lambda t: t * float("nan")),
    "an added client entry": lambda c: _with_key(c, "0/evil"),
}


@pytest.mark.parametrize("craft", sorted(CLIENT_CRAFTED))
@pytest.mark.parametrize("command", ["resume", "export"])
def test_a_crafted_client_state_falls_back_to_the_last_intact_checkpoint(fedalt_rounds, tmp_path, capsys, craft,
                                                                         command):
    """A personalised run's client states are checked like the server's, before anything uses them: resume and
    ``export --format routed --client K`` fall back to round 2's checkpoint with one line naming the defect."""
    run_dir = _copy(fedalt_rounds, tmp_path)
    _forge(run_dir / "checkpoints" / "round-00003", clients=CLIENT_CRAFTED[craft])
    if command == "resume":
        assert main(["resume", str(run_dir), "--quiet"]) == 0
    else:
        client = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["replied"][0]
        assert main(["export", str(run_dir), "--format", "routed", "--client", str(client), "--out",
                     str(tmp_path / "export")]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "round-00003" in x)
    assert "clients" in line and "using round-00002" in line and "Traceback" not in err, err


# -- what resume cannot delete, a full disk, an emptied finished run: one line each --------------------------------
def test_resume_before_a_checkpoint_it_cannot_delete_changes_nothing(three_rounds, tmp_path, capsys, monkeypatch):
    import fedlowrank.runtime.rundir as rundir

    run_dir = _copy(three_rounds[0], tmp_path)
    before = listing(run_dir)
    rename = os.rename

    def immutable(src, dst, *args, **kwargs):
        if os.path.basename(src) == "round-00003":
            raise PermissionError(1, "Operation not permitted")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(rundir.os, "rename", immutable)
    assert main(["resume", str(run_dir), "--round", "2", "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: resuming after round 2") and \
        "round-00003 (Operation not permitted)" in line, line
    assert listing(run_dir) == before


def test_resume_refuses_a_linked_checkpoint_and_never_follows_it(three_rounds, tmp_path, capsys):
    import shutil

    run_dir = _copy(three_rounds[0], tmp_path)
    elsewhere = shutil.copytree(run_dir / "checkpoints" / "round-00003", tmp_path / "elsewhere")
    (run_dir / "checkpoints" / "round-00009").symlink_to(elsewhere, target_is_directory=True)
    before = listing(run_dir), listing(elsewhere)
    assert main(["resume", str(run_dir), "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and "round-00009 is a symbolic link" in line and "move it out" in line, line
    assert (listing(run_dir), listing(elsewhere)) == before


def test_a_full_disk_is_one_line_naming_the_directory(finished_run, tmp_path, capsys, monkeypatch):
    import fedlowrank.export as export
    from fedlowrank.runtime.rundir import RunFiles

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RunFiles, "append_round", full)
    out = tmp_path / "run"
    assert main(["run", "tiny", "--out", str(out), "--quiet", "--set", "run.rounds=1"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == f"error: run directory {out}: No space left on device while writing it; free space on that " \
                   f"disk or choose another directory", line

    def full_in_a_library(*args, **kwargs):
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(export, "_write_export", full_in_a_library)
    assert main(["export", str(finished_run), "--out", str(tmp_path / "exp")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: --out {tmp_path / 'exp'}: No space left on device"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_compare_resume_runs_again_a_finished_run_whose_metrics_were_emptied(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    argv = ["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(cmp), "--quiet",
            "--set", "run.rounds=2"]
    assert main(argv) == 0
    (cmp / "fedit-seed0" / "metrics.jsonl").write_text("")
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert rounds_in(cmp / "fedit-seed0") == [1, 2]


def test_a_checkpoint_of_a_config_with_fewer_keys_resumes(three_rounds, tmp_path, capsys):
    """A run written by a fedlowrank whose configs had fewer keys (here: without the [uplink] and [downlink] sections
    added since): its config.json lacks them and its checkpoints carry that config's fingerprint. It resumes, the
    new keys at their defaults; a config.json edited in a key the run computes with is still refused."""
    from fedlowrank.runtime.checkpoint import dict_fingerprint

    run_dir = _copy(three_rounds[0], tmp_path)
    config = json.loads((run_dir / "config.json").read_text())
    older = {k: v for k, v in config.items() if k not in ("uplink", "downlink")}
    (run_dir / "config.json").write_text(json.dumps(older))
    for rnd in (2, 3):
        _forge(run_dir / "checkpoints" / f"round-0000{rnd}",
               record=lambda r: {**r, "config_fingerprint": dict_fingerprint(older)})
    assert main(["resume", str(run_dir), "--round", "2", "--quiet"]) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy"] == three_rounds[1]["accuracy"] and summary["bytes_up"] == three_rounds[1]["bytes_up"]
    edited = {**older, "train": {**older["train"], "lr": 0.5}}
    (run_dir / "config.json").write_text(json.dumps(edited))
    assert main(["resume", str(run_dir), "--quiet"]) == 2
    assert "was written with another config" in capsys.readouterr().err
