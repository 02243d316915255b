"""Suite-wide settings.

* One torch thread: the tests use tiny models, where more threads only add contention on a shared 2-core machine,
  and every comparison then sums floats in the same order.
* No network: ``HF_HUB_OFFLINE=1`` unless the environment sets it, so that a test never waits on the Hugging Face
  hub; AG News and GSM8K come from ``FEDLOWRANK_DATA`` or the ``datasets`` cache, else their tests skip
  (``helpers.require_dataset``).
* Hypothesis keeps no example database, draws its examples from a fixed seed and keeps its caches under
  ``$XDG_CACHE_HOME/fedlowrank/hypothesis`` (``~/.cache/...``), not in a ``.hypothesis/`` folder of the checkout.
* No test leaves a file in the checkout: every test writes under ``tmp_path`` (runs: ``--out`` or
  ``run.out_dir``); a test that adds a file or folder fails at teardown, naming what it left.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fedlowrank", "hypothesis"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.set_num_threads(1)
settings.register_profile("fedlowrank", database=None, derandomize=True)
settings.load_profile("fedlowrank")

CHECKOUT = Path(__file__).resolve().parents[1]
# Made by the tools around the tests, not by a test: git, the virtual environment, bytecode, pytest's cache and an
# editable install's metadata.
NOT_TEST_OUTPUT = (".git", ".venv", "__pycache__", ".pytest_cache")


def checkout_entries() -> set[str]:
    """Every file and folder of the checkout (relative paths), less :data:`NOT_TEST_OUTPUT` and ``*.egg-info``."""
    entries: set[str] = set()
    for folder, dirs, files in os.walk(CHECKOUT):
        dirs[:] = [d for d in dirs if d not in NOT_TEST_OUTPUT and not d.endswith(".egg-info")]
        base = Path(folder).relative_to(CHECKOUT)
        entries.update(str(base / name) for name in dirs + files)
    return entries


@pytest.fixture(autouse=True)
def leaves_the_checkout_as_it_was(request):
    """Fail a test that added files or folders to the checkout (it must write under ``tmp_path``)."""
    before = checkout_entries()
    yield
    added = sorted(checkout_entries() - before)
    if added:
        pytest.fail(f"{request.node.nodeid} left {', '.join(added)} in the checkout {CHECKOUT}; tests write under "
                    "tmp_path (a run: --out or run.out_dir)", pytrace=False)
