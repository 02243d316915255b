"""The protocols of Fed-SB, FSLoRA, FedMomentum, FedASK and SDFLoRA in benchmarks/protocols.py: every method's runs
resolve to a valid config with the ranks, budgets and privacy settings each claim needs (compare's resolution:
preset, protocol settings, compare.overrides), and the DP noise keeps the stated ε bound."""

import numpy as np
import pytest
from helpers import benchmark_module

from fedlowrank.config import load_config
from fedlowrank.experiments.compare import method_settings
from fedlowrank.privacy.accountant import epsilon

NEW = ["fed-sb-uplink", "fed-sb-dp", "fslora-budgets", "fedmomentum", "fedmomentum-gsm8k", "fedask-dp3", "fedask-dp1",
       "fedask", "sdflora-personal", "sdflora-dp"]


@pytest.fixture(scope="module")
def protocols():
    return benchmark_module("protocols").PROTOCOLS


def resolved(p, method: str):
    """``method``'s config in protocol ``p`` as compare resolves it."""
    base = load_config(p.config, [f"method.name={method}", *p.sets])
    return load_config(p.config, method_settings(base, method, p.sets))


@pytest.mark.parametrize("name", NEW)
def test_every_method_of_the_protocol_resolves_and_has_seeds_enough_for_a_verdict(protocols, name):
    p = protocols[name]
    configs = {m: resolved(p, m) for m in p.methods}
    assert p.reference == p.methods[0] and len(p.seeds.split(",")) >= 6       # the signed-rank test needs 6
    assert all(c.method_name == m for m, c in configs.items())
    assert len({(c.partition.num_clients, c.run.rounds, c.run.clients_per_round, c.train.local_steps)
                for c in configs.values()}) == 1                              # one budget for every method


def test_fed_sb_runs_at_an_uplink_below_fedits(protocols):
    p = protocols["fed-sb-uplink"]
    sb, fedit = resolved(p, "fed-sb"), resolved(p, "fedit")
    d = 384                                                                   # MiniLM's query/value projections
    assert sb.lora.rank == 64 and fedit.lora.rank == 8 and sb.lora.rank ** 2 < fedit.lora.rank * 2 * d
    dp = protocols["fed-sb-dp"]
    assert resolved(dp, "fed-sb").lora.rank == 32 and resolved(dp, "ffa-lora").lora.rank == 8


def test_fslora_and_hetlora_share_the_budgets_of_the_codes_normal_draw(protocols):
    p = protocols["fslora-budgets"]
    fs, het = resolved(p, "fslora"), resolved(p, "hetlora")
    draw = np.clip(np.round(np.random.default_rng(42).normal(16.5, 31 / 6, 10)), 1, 32).astype(int).tolist()
    assert fs.lora.ranks == het.lora.ranks == draw and fs.lora.server_rank == 32
    assert fs.partition.num_clients == len(draw)


@pytest.mark.parametrize("name, target, participations", [("fed-sb-dp", 3, 30), ("sdflora-dp", 3, 30),
                                                           ("fedask-dp3", 3, 20), ("fedask-dp1", 1, 20)])
def test_the_dp_noise_keeps_every_client_within_the_claims_epsilon(protocols, name, target, participations):
    """Each method's runs train under DP-SGD with the same σ, and a client of the smallest allowed size that takes
    part ``participations`` times stays within ε (δ = 1/its examples), as the accountant of each round's row."""
    p = protocols[name]
    configs = [resolved(p, m) for m in p.methods]
    assert all(c.privacy.dpsgd for c in configs) and len({c.privacy.dpsgd_noise for c in configs}) == 1
    c = configs[0]
    n = c.partition.min_partition_size
    steps = participations * c.train.local_steps
    assert participations <= c.run.rounds
    eps = epsilon(c.train.batch_size / n, c.privacy.dpsgd_noise, steps, 1 / n)
    assert target * 0.95 < eps <= target, eps                                  # within, and not far below


def test_the_non_private_fedask_protocol_has_no_dp(protocols):
    assert not any(resolved(protocols["fedask"], m).privacy.dpsgd for m in protocols["fedask"].methods)
    assert resolved(protocols["fedask"], "fedask").partition.alpha == 0.1
