"""Ownership, not names: a directory is changed by `run`, `resume`, `export` or `compare` only when it holds the claim
file a fedlowrank command wrote, and `--overwrite` removes only the entries that claim lists, all or none."""

import json
import os
import shutil
import subprocess

import pytest
from helpers import tiny_config, tiny_task
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlowrank.cli import main
from fedlowrank.runtime import rundir
from fedlowrank.runtime.rundir import CLAIM, read_claim
from fedlowrank.runtime.simulator import Simulation

ONE_ROUND = ["--quiet", "--set", "run.rounds=1"]


def snapshot(folder):
    """Every entry under ``folder`` (links as their targets' names, never followed) with its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    out[rel] = ("file", fh.read())
            else:
                out[rel] = ("dir", None)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-round tiny FedIT run (checkpoint at round 2) and an export of it."""
    base = tmp_path_factory.mktemp("own")
    run_dir = base / "run"
    Simulation(tiny_config("run.rounds=2"), task=tiny_task(), run_dir=run_dir).run()
    assert main(["export", str(run_dir), "--out", str(base / "export")]) == 0
    return run_dir, base / "export"


def test_overwrite_does_not_trust_a_file_name(tmp_path, finished, capsys):
    v3 = tmp_path / "V3"
    v3.mkdir()
    (v3 / "thesis.tex").write_text("x")
    (v3 / "ledger.jsonl").write_text("{}")
    before = snapshot(v3)
    assert main(["run", "tiny", "--overwrite", "--out", str(v3), *ONE_ROUND]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "holds no fedlowrank run" in err
    assert snapshot(v3) == before
    e2 = tmp_path / "E2"
    e2.mkdir()
    (e2 / "export.json").write_text("{}")
    (e2 / "thesis.tex").write_text("x")
    before = snapshot(e2)
    assert main(["export", str(finished[0]), "--out", str(e2), "--overwrite"]) == 2
    assert "holds no fedlowrank export" in capsys.readouterr().err and snapshot(e2) == before


def test_overwrite_refuses_a_run_or_export_holding_a_file_no_command_wrote(tmp_path, finished, capsys):
    run_dir, export = (shutil.copytree(p, tmp_path / p.name, symlinks=True) for p in finished)
    for folder in (run_dir, export):
        (folder / "thesis.tex").write_text("precious")
    (run_dir / "checkpoints" / "notes.txt").write_text("mine")  # inside an own folder: the folder is the run's
    before = snapshot(run_dir), snapshot(export)
    assert main(["run", "tiny", "--overwrite", "--out", str(run_dir), *ONE_ROUND]) == 2
    assert "holds thesis.tex, which no fedlowrank command wrote" in capsys.readouterr().err
    assert main(["export", str(finished[0]), "--out", str(export), "--overwrite"]) == 2
    assert "holds thesis.tex, which the export did not write" in capsys.readouterr().err
    assert (snapshot(run_dir), snapshot(export)) == before
    (export / "thesis.tex").unlink()
    assert main(["export", str(finished[0]), "--out", str(export), "--overwrite", "--format", "merged"]) == 0
    assert read_claim(export).kind == "export" and "model.safetensors" in read_claim(export).own


def test_a_claim_of_another_kind_or_a_forged_one_is_refused(tmp_path, finished, capsys):
    export = shutil.copytree(finished[1], tmp_path / "export")
    before = snapshot(export)
    assert main(["run", "tiny", "--overwrite", "--out", str(export), *ONE_ROUND]) == 2
    assert "the output of `fedlowrank export`" in capsys.readouterr().err and snapshot(export) == before
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / CLAIM).write_text(json.dumps({"kind": "run", "id": "x", "own": ["../thesis.tex"]}))
    (forged / "config.json").write_text("{}")
    before = snapshot(forged)
    assert main(["run", "tiny", "--overwrite", "--out", str(forged), *ONE_ROUND]) == 2
    assert snapshot(forged) == before


def test_overwrite_removes_all_or_nothing(tmp_path, finished, capsys, monkeypatch):
    run_dir = shutil.copytree(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    rename = os.rename

    def immutable_summary(src, dst, *args, **kwargs):
        if os.path.basename(src) == "summary.json":
            raise PermissionError(1, "Operation not permitted")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(rundir.os, "rename", immutable_summary)
    assert main(["run", "tiny", "--overwrite", "--out", str(run_dir), *ONE_ROUND]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot remove {run_dir / 'summary.json'}" in err and "nothing was removed" in err
    assert snapshot(run_dir) == before


def test_overwrite_refuses_an_immutable_old_file_before_removing_anything(tmp_path, finished, capsys, monkeypatch):
    """A file marked immutable (chattr +i) deep in the old run cannot be deleted by anyone: refused first, in one
    line naming it, with the directory as it was (no hidden .overwrite.tmp folder left)."""
    run_dir = shutil.copytree(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    stuck = sorted((run_dir / "checkpoints").rglob("server.safetensors"))[0]
    monkeypatch.setattr(rundir, "file_flags", lambda path: rundir.FS_IMMUTABLE_FL if path == stuck else 0)
    assert main(["run", "tiny", "--overwrite", "--out", str(run_dir), *ONE_ROUND]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot remove {stuck} (marked immutable" in err and \
        "nothing was removed" in err, err
    assert snapshot(run_dir) == before and not list(run_dir.glob(".overwrite.tmp-*"))


def test_an_immutable_file_is_seen_by_its_flags(tmp_path):
    """The real flag, where the file system has it (chattr +i on ext4, as root)."""
    target = tmp_path / "f"
    target.write_text("x")
    if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        assert rundir.file_flags(target) & rundir.FS_IMMUTABLE_FL
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    assert not rundir.file_flags(target) & rundir.FS_IMMUTABLE_FL


def test_overwrite_that_cannot_delete_what_it_moved_says_so(tmp_path, finished, capsys, monkeypatch):
    """A deletion that fails after the old entries were moved aside (no flag foretold it) is one line naming what is
    left and where, never a silent success."""
    run_dir = shutil.copytree(finished[0], tmp_path / "run")
    unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if os.path.basename(path) == "summary.json":
            raise PermissionError(1, "Operation not permitted")
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(rundir.shutil.os, "unlink", refuse)
    assert main(["run", "tiny", "--overwrite", "--out", str(run_dir), *ONE_ROUND]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot delete" in err and "summary.json (Operation not permitted)" in err \
        and ".overwrite.tmp-" in err, err


def test_overwrite_checks_every_folder_it_would_empty_first(tmp_path, finished, capsys, monkeypatch):
    run_dir = shutil.copytree(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    locked = run_dir / "checkpoints" / "round-00002"
    monkeypatch.setattr(rundir.os, "access", lambda path, mode: os.fspath(path) != os.fspath(locked))
    assert main(["run", "tiny", "--overwrite", "--out", str(run_dir), *ONE_ROUND]) == 2
    assert f"cannot remove the entries of {locked}" in capsys.readouterr().err
    assert snapshot(run_dir) == before


def test_overwrite_removes_a_link_it_recorded_never_its_target(tmp_path, finished):
    run_dir = shutil.copytree(finished[0], tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "thesis.tex").write_text("precious")
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").symlink_to(outside, target_is_directory=True)  # an own name, now a link
    assert main(["run", "tiny", "--overwrite", "--out", str(run_dir), *ONE_ROUND]) == 0
    assert snapshot(outside) == {"thesis.tex": ("file", b"precious")}
    assert not (run_dir / "checkpoints").is_symlink()
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("name", ["/abs", "../../escape", "a/b", "", ".hidden", "x" * 65, "a\\b"])
def test_run_name_is_a_plain_name(name, tmp_path, capsys):
    out_dir = tmp_path / "runs"
    assert main(["run", "tiny", "--set", f"run.name={name}", "--set", f"run.out_dir={out_dir}", *ONE_ROUND]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: run.name must be a plain name"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


NAMES = st.sampled_from(["thesis.tex", "ledger.jsonl", "metrics.jsonl", "config.json", "summary.json",
                         "export.json", "checkpoints", "results.json", CLAIM, ".lock", "notes"])
CONTENTS = st.one_of(st.binary(max_size=40), st.just(b"{}"),
                     st.builds(lambda kind, own: json.dumps({"fedlowrank": "", "kind": kind, "id": "0" * 31,
                                                            "own": own}).encode(),
                               st.sampled_from(["run", "export", "compare"]), st.lists(NAMES, max_size=3)))
FOLDERS = st.dictionaries(NAMES, CONTENTS, min_size=1, max_size=4)


def make_folder(path, files):
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)


def commands(folder, finished):
    run_dir = str(finished[0])
    for extra in ([], ["--overwrite"]):
        yield ["run", "tiny", "--out", str(folder), *ONE_ROUND, *extra]
        yield ["export", run_dir, "--out", str(folder), *extra]
        yield ["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(folder), *ONE_ROUND, *extra]
    yield ["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(folder), *ONE_ROUND, "--resume"]
    yield ["resume", str(folder), "--quiet"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=FOLDERS)
def test_no_command_modifies_a_folder_of_files_it_did_not_create(files, tmp_path_factory, finished):
    folder = tmp_path_factory.mktemp("user") / "folder"
    make_folder(folder, files)
    before = snapshot(folder)
    for argv in commands(folder, finished):
        assert main(argv) == 2, argv
        assert snapshot(folder) == before, argv


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.dictionaries(st.sampled_from(["thesis.tex", "notes", "data.csv"]), st.binary(max_size=20),
                             min_size=1, max_size=2))
def test_no_command_modifies_a_users_file_inside_a_run_or_an_export(files, tmp_path_factory, finished):
    base = tmp_path_factory.mktemp("mixed")
    run_dir, export = (shutil.copytree(p, base / p.name) for p in finished)
    for folder in (run_dir, export):
        for name, data in files.items():
            (folder / name).write_bytes(data)
    runs, exports = snapshot(run_dir), snapshot(export)
    for argv in (["run", "tiny", "--out", str(run_dir), *ONE_ROUND, "--overwrite"],
                 ["export", str(finished[0]), "--out", str(export), "--overwrite"],
                 ["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(run_dir), *ONE_ROUND,
                  "--overwrite"]):
        assert main(argv) == 2, argv
    assert (snapshot(run_dir), snapshot(export)) == (runs, exports)
    assert main(["resume", str(run_dir), "--quiet"]) == 0  # continues the run (complete: nothing to do)
    assert all((run_dir / name).read_bytes() == data for name, data in files.items())


def test_overwrite_removes_the_claim_temporary_of_a_killed_writer(tmp_path, finished):
    import subprocess
    import sys

    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True).stdout)
    run_dir = shutil.copytree(finished[0], tmp_path / "run")
    (run_dir / f".claim.tmp-{pid}").write_text("{")  # killed while recording a name
    assert main(["run", "tiny", "--overwrite", "--out", str(run_dir), *ONE_ROUND]) == 0
    assert not (run_dir / f".claim.tmp-{pid}").exists() and read_claim(run_dir).kind == "run"
