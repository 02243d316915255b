"""Bad replies over Flower's message contract (the strategy and the ClientApp in this process, tests/test_flower.py):
for every registered method, the attacks of tests/test_replies.py are rejected and the run ends with the state of a
simulated run in which the attacking clients did not reply."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from helpers import tiny_task  # noqa: E402
from test_flower import assert_same_state, flower_process, run_flower  # noqa: E402,F401 (flower_process: autouse)
from test_replies import (FEDERATED, METHOD_SETTINGS, ROUND, _cfg, _everything_huge, attack,  # noqa: E402
                          attackers)

from fedlowrank.config import load_config  # noqa: E402
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


@pytest.mark.parametrize("method", FEDERATED)
def test_a_lone_bad_reply_over_the_message_contract_never_ends_nor_poisons_the_run(method):
    """Two nodes, node 1 never replies: round 1's only reply is node 0's 3e38 (rejected, measured against what it was
    sent), round 2's its honest one; the run ends with the state of a simulated run without round 1's replies."""
    sets = ["partition.num_clients=2", "partition.kind=iid", "run.clients_per_round=2", "run.rounds=2",
            *METHOD_SETTINGS.get(method, [])]

    def tamper(client, reply):
        if client == 0 and not sim_rows:
            sim_rows.append(client)
            put_records(reply.content, _everything_huge(from_records(reply.content, Message)))

    sim_rows: list[int] = []
    sim, *_ = run_flower(f"method.name={method}", *sets, drop=(1,), tamper=tamper)
    absent = Simulation(load_config("tiny", [f"method.name={method}", *sets,
                                             "run.dropout_schedule=[[1, 0], [1, 1], [2, 1]]"]), task=tiny_task())
    absent.run()
    first, second = sim.history
    assert first["skipped"] and [r["client"] for r in first["rejected"]] == [0]
    assert "server.outlier_ratio" in first["rejected"][0]["reason"]
    assert second["replied"] == [0] and "rejected" not in second
    assert_same_state(sim.server, absent.server)
