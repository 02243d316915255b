"""The FLoRG protocols of benchmarks/protocols.py: ``florg`` runs each method's preset (FLoRG uniform, FedIT by
examples); ``florg-uniform`` and ``florg-examples`` must weight every method alike, which means the protocol's
settings win over a method's preset (docs/methods/florg.md, "Why FLoRG collapsed on some seeds")."""

import pytest
from helpers import benchmark_module

from fedlowrank.config import load_config
from fedlowrank.experiments.compare import method_settings


@pytest.fixture(scope="module")
def protocols():
    """benchmarks/protocols.py as a module (it imports its neighbour ``common``)."""
    return benchmark_module("protocols").PROTOCOLS


def resolved_weighting(p, method: str) -> str:
    """``server.weighting`` of ``method``'s runs as compare resolves them (preset, then the protocol's settings)."""
    base = load_config(p.config, [f"method.name={method}", *p.sets])
    return load_config(p.config, method_settings(base, method, p.sets)).server.weighting


@pytest.mark.parametrize("name, weighting", [("florg-uniform", "uniform"), ("florg-examples", "num_examples")])
def test_one_weighting_for_every_method(protocols, name, weighting):
    p = protocols[name]
    assert p.tuned_in is None and set(p.methods) == {"florg", "fedit"}
    assert len(p.tune_seeds.split(",")) >= 3  # each method's rate tuned under this weighting on three splits
    assert {m: resolved_weighting(p, m) for m in p.methods} == {m: weighting for m in p.methods}


def test_the_florg_protocol_runs_each_method_s_preset(protocols):
    p = protocols["florg"]
    assert resolved_weighting(p, "florg") == "uniform" and resolved_weighting(p, "fedit") == "num_examples"
