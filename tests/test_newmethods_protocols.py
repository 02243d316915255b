"""The protocols of FedRot-LoRA, FedSVD and RAVAN in benchmarks/protocols.py resolve to valid configs, and RAVAN's
compares at FedIT's number of trained parameters."""

import pytest
from test_florg_protocol import protocols  # noqa: F401  (the fixture)

from fedlowrank.config import load_config
from fedlowrank.experiments.compare import method_settings

NAMES = ["fedrot-10", "fedrot-50", "fedsvd", "fedsvd-dp", "ravan-params"]


def resolved(p, method: str):
    base = load_config(p.config, [f"method.name={method}", *p.sets])
    return load_config(p.config, method_settings(base, method, p.sets))


@pytest.mark.parametrize("name", NAMES)
def test_every_method_of_the_protocol_resolves_to_a_valid_config(protocols, name):  # noqa: F811
    p = protocols[name]
    assert len(p.seeds.split(",")) >= 6 and p.reference == p.methods[0]
    for method in p.methods:
        assert resolved(p, method).method_name == method


def test_ravan_trains_as_many_parameters_per_target_as_fedit(protocols):  # noqa: F811
    p = protocols["ravan-params"]
    ravan, fedit = resolved(p, "ravan"), resolved(p, "fedit")
    d = 384                                                   # MiniLM-L6's hidden size: query, value are 384×384
    assert ravan.method_options["heads"] * ravan.lora.rank ** 2 == fedit.lora.rank * (d + d) == 3072
    assert resolved(protocols["fedrot-50"], "fedit").partition.num_clients == 50
