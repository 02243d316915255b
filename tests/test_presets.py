"""Per-method presets: the papers' own settings as config overrides, and their learning-rate grids."""

import pytest

from fedlowrank.config import load_config
from fedlowrank.methods import DEFAULT_LR_GRID, available_methods, lr_grid, preset_overrides


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_every_preset_loads_as_config_overrides(name):
    """Each preset entry names a real config field, survives ``--set`` parsing and validates."""
    overrides = preset_overrides(name) + [f"method.name={name}"]
    cfg = load_config(None, overrides).to_dict()
    for key, value in available_methods()[name].preset.items():
        section, field = key.split(".")
        assert cfg[section][field] == value
    grid = lr_grid(name)
    assert grid and all(lr > 0 for lr in grid) and grid == sorted(grid)


def test_user_overrides_win_over_the_preset():
    cfg = load_config(None, preset_overrides("scaffold") + ["server.weighting=num_examples"])
    assert cfg.server.weighting == "num_examples" and cfg.train.optimizer == "sgd"


def test_papers_settings():
    """FLoRG (eq. 4), FedRPCA (eqs. 4, 10, 11) and SCAFFOLD (Alg. 1) weight clients uniformly; FFA-LoRA and
    LoRA-FAIR ran with SGD in FedGaLore's study; the grids of benchmarks/protocols.py."""
    for name in ("florg", "florg-no-procrustes", "fedrpca", "scaffold"):
        assert 'server.weighting="uniform"' in preset_overrides(name)
    for name in ("ffa-lora", "lora-fair", "scaffold", "ssf", "fedsub"):
        assert 'train.optimizer="sgd"' in preset_overrides(name)
    assert lr_grid("florg") == [1e-3, 3e-3, 1e-2]
    assert lr_grid("ilora") == lr_grid("ilora-s") == [3e-4, 1e-3, 3e-3]
    assert preset_overrides("fedit") == [] and lr_grid("fedit") == list(DEFAULT_LR_GRID)


def test_ssf_study_methods_take_one_step_size_for_every_parameter():
    """SSF's Alg. 1 (and its comparators') SGD has one η_l: the head follows the tuned ``train.lr`` even where
    the config gives the head its own (AdamW) rate, as agnews does (there the head never moved under SGD)."""
    assert load_config("agnews").train.head_lr > 0
    for name in ("ssf", "fedsub", "scaffold-full"):
        cfg = load_config("agnews", preset_overrides(name) + [f"method.name={name}", "train.lr=0.1"])
        assert cfg.train.optimizer == "sgd" and cfg.train.head_lr == 0.0
