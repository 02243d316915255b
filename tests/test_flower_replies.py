"""Bad replies over Flower's message contract (the strategy and the ClientApp in this process, tests/test_flower.py):
for every registered method, the attacks of tests/test_replies.py are rejected and the run ends with the state of a
simulated run in which the attacking clients did not reply."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from helpers import tiny_task  # noqa: E402
from test_flower import assert_same_state, flower_process, run_flower  # noqa: E402,F401 (flower_process: autouse)
from test_replies import FEDERATED, METHOD_SETTINGS, ROUND, _cfg, attack, attackers  # noqa: E402

from fedlowrank.message import Message  # noqa: E402
from fedlowrank.runtime.flower.records import from_records, put_records  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402


@pytest.mark.parametrize("method", FEDERATED)
def test_bad_replies_over_the_message_contract_leave_the_honest_result(method):
    cfg = _cfg(method)
    plan = {k: i for i, k in enumerate(attackers(cfg))}
    done: set[int] = set()

    def tamper(client, reply):
        if client in plan and client not in done:  # every client is sampled every round: its first reply is round 1's
            done.add(client)
            put_records(reply.content, attack(from_records(reply.content, Message), plan[client]))

    sim, *_ = run_flower(f"method.name={method}", *ROUND, *METHOD_SETTINGS.get(method, []), tamper=tamper)
    absent = Simulation(_cfg(method, f"run.dropout_schedule={[[1, k] for k in plan]}"), task=tiny_task())
    absent.run()
    assert sorted(r["client"] for r in sim.history[0]["rejected"]) == sorted(plan)
    assert "rejected" not in sim.history[1]
    assert_same_state(sim.server, absent.server)
