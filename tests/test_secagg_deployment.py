"""SecAgg+ on a real local SuperLink and two SuperNodes (Flower's ``SecAggPlusWorkflow`` + ``secaggplus_mod``):
the global model equals the plain aggregation (the in-process simulator) up to SecAgg+'s quantisation, for FedIT
and FFA-LoRA. Slow (a deployment); the processes are started and killed as in ``test_flower_deployment.py``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

import test_flower_deployment as deployment  # noqa: E402
import torch  # noqa: E402
from helpers import run_tiny  # noqa: E402

UNIFORM = ("server.weighting=uniform",)


class SecAggFederation(deployment.Federation):
    def run_secagg(self, run_dir, *sets: str, rounds: int):
        """``flwr run`` of the tiny config with ``sets`` and ``flower.secagg = true``; returns the CLI process."""
        overrides = self.tmp / f"{run_dir.name}.toml"
        quoted = " ".join(f"'{s}'" for s in (*deployment.SETS, *sets))
        overrides.write_text(f'config = "tiny"\nset = "{quoted}"\n"run.rounds" = {rounds}\n"flower.secagg" = true\n'
                             f'"flower.run-dir" = "{run_dir}"\n"flower.round-timeout" = 300.0\n')
        return self.launch_app(run_dir.name, "--run-config", str(overrides))


@pytest.fixture
def federation(tmp_path):
    yield from deployment.launched(SecAggFederation(tmp_path))


def test_secagg_matches_plain_aggregation(federation, tmp_path):
    for method in ("fedit", "ffa-lora"):
        run_dir = tmp_path / method
        cli = federation.run_secagg(run_dir, f"method.name={method}", *UNIFORM, rounds=1)
        assert cli.wait(timeout=400) == 0, federation.dump()
        log = federation.logs[-1].read_text()
        ref = run_tiny(method, *deployment.SETS, *UNIFORM, rounds=1)
        got = deployment.load_state(run_dir)
        assert sorted(got.tensors()) == sorted(ref.server.tensors())
        for k in got.tensors():
            # quantisation steps of 2·8/2²² ≈ 3.8e-6 per coordinate, carried through training
            torch.testing.assert_close(got[k], ref.server[k], rtol=0, atol=1e-4, msg=k)
        assert "Secure aggregation completed" in log, federation.dump()
        # the protocol's own messages are counted: the masked vectors alone outweigh the plaintext replies
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert row["flower_bytes_up"] > row["bytes_up"] and row["flower_bytes_down"] > 0, row
