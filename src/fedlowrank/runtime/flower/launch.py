"""``flwr run`` that fails when the run fails.

``flwr run APP CONNECTION --stream`` (flwr 1.41) exits 0 once the run has ended, whether its ServerApp finished or
raised. This entry point runs it, then asks the SuperLink for the run's final status (``flwr ls CONNECTION --run-id N
--format json``) and exits with 0 only for ``finished:completed``; otherwise it prints the status and its details in
one line and exits 1::

    python -m fedlowrank.runtime.flower.launch examples/flower_app CONNECTION [flwr run options ...]

(``--stream`` is added when missing.) The ServerApp itself raises on any error, so Flower records the run as
``finished:failed`` (``docs/flower.md``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

FLWR = Path(sys.executable).parent / "flwr"  # installed next to this interpreter
COMPLETED = "finished:completed"


def run_id_of(output: str) -> int | None:
    """The run id in ``flwr run``'s output (``Successfully started run N``)."""
    found = re.search(r"Successfully started run (\d+)", output)
    return int(found.group(1)) if found else None


def run_status(connection: str, run_id: int, flwr: str | Path = FLWR, wait: float = 30.0) -> tuple[str, str]:
    """``(status, details)`` of run ``run_id`` on the SuperLink of ``connection`` once it is finished (waiting up to
    ``wait`` seconds), or its last status."""
    deadline = time.monotonic() + wait
    status, details = "unknown", ""
    while True:
        out = subprocess.run([str(flwr), "ls", connection, "--run-id", str(run_id), "--format", "json"],
                             capture_output=True, text=True)
        start = out.stdout.find("{")
        try:
            runs = json.loads(out.stdout[start:])["runs"] if start >= 0 else []
        except (ValueError, KeyError, TypeError):
            runs = []
        if runs:
            status, details = str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))
        if status.startswith("finished") or time.monotonic() >= deadline:
            return status, details
        time.sleep(1.0)


def launch(argv: list[str], flwr: str | Path = FLWR) -> int:
    """Run ``flwr run *argv`` (streaming its logs) and return 0 if the run completed, 1 otherwise (a line on stderr
    says why), or ``flwr run``'s own non-zero status."""
    if len(argv) < 2:
        print("usage: python -m fedlowrank.runtime.flower.launch APP CONNECTION [flwr run options ...]", file=sys.stderr)
        return 2
    args = [*argv, *([] if "--stream" in argv else ["--stream"])]
    proc = subprocess.Popen([str(flwr), "run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # stream Flower's output as it comes
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    status = proc.wait()
    if status != 0:
        return status
    run_id = run_id_of("".join(lines))
    if run_id is None:
        print("error: flwr run started no run (no 'Successfully started run N' in its output)", file=sys.stderr)
        return 1
    final, details = run_status(argv[1], run_id, flwr)
    if final != COMPLETED:
        print(f"error: Flower run {run_id} ended as {final}" + (f": {details}" if details else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
