"""The method contract's declarations: one declaration of the correction options, and what every registered method
declares agrees with what it implements."""

from __future__ import annotations

import json
from pathlib import Path

from fedlowrank.methods import available_methods, preset_overrides
from fedlowrank.methods.base import Corrected
from fedlowrank.schema import declared

SNAPSHOT = Path(__file__).parent / "data" / "method_declarations.json"
# options that the one corrected base gave methods that lacked them: SCAFFOLD's refresh rule, for the methods that
# allow SCAFFOLD (full fine-tuning, FedGaLore) and for RAVAN (as for every LoRA method refusing SCAFFOLD)
ADDED = {name: {"cv_grad"} for name in ("fedavg-full", "scaffold-full", "fedgalore", "fedgalore-minus", "ravan")}


def _declarations(name, cls) -> dict:
    options = {k: {"default": d.default, "allowed": list(d.setting.allowed()) if d.setting.allowed() else None}
               for k, d in declared(cls).items() if k not in ADDED.get(name, ())}
    return {"options": options, "preset": preset_overrides(name)}


def test_options_defaults_and_presets_unchanged_by_the_corrected_base():
    before = json.loads(SNAPSHOT.read_text())
    after = json.loads(json.dumps({n: _declarations(n, c) for n, c in available_methods().items()}))
    assert {n: after[n] for n in before} == before


def test_the_correction_options_are_declared_once():
    """Every method with a ``correction`` option is a :class:`Corrected`; ``mu`` and ``cv_grad`` are its declarations
    (a method only narrows ``correction``'s default and allowed values)."""
    base = declared(Corrected)
    for name, cls in available_methods().items():
        options = declared(cls)
        if "correction" not in options:
            continue
        assert issubclass(cls, Corrected), name
        for key in ("mu", "cv_grad"):
            assert options[key].setting is base[key].setting, (name, key)
        assert set(options["correction"].setting.allowed()) <= set(base["correction"].setting.allowed()), name


def test_a_corrected_method_makes_its_corrections_from_its_options():
    from fedlowrank.methods import get_method

    for name in ("fedit", "fedavg-full", "florg", "ravan"):
        method = get_method(name, correction="fedprox", mu=0.5)
        assert [type(c).__name__ for c in method.composed_corrections()] == ["FedProx"], name
        assert method.composed_corrections()[0].mu == 0.5
        member = method.cohort_member()
        assert member.composed_corrections()[0] is not method.composed_corrections()[0]
