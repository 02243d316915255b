"""The suite's own guard (``conftest.leaves_the_checkout_as_it_was``): it sees what a test adds to the checkout."""

import os

from conftest import CHECKOUT, checkout_entries


def test_a_new_file_or_folder_in_the_checkout_is_seen_and_tool_folders_are_not():
    before = checkout_entries()
    assert "src/fedlowrank/cli.py" in before and not any("__pycache__" in e for e in before)
    folder = CHECKOUT / "runs-guard-probe"
    try:
        folder.mkdir()
        (folder / ".lock").write_text("")
        (folder / "__pycache__").mkdir()
        assert checkout_entries() - before == {"runs-guard-probe", os.path.join("runs-guard-probe", ".lock")}
    finally:
        (folder / "__pycache__").rmdir()
        (folder / ".lock").unlink()
        folder.rmdir()
    assert checkout_entries() == before
