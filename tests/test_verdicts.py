"""Verdicts that read right: collapse detection, the reference rows (centralized, local-only), and the settings a
comparison applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedlowrank.config import from_dict
from fedlowrank.runtime.evaluation import COLLAPSE_SHARE, collapse_of, run_collapse
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks.base import confusion_counts, prediction_summary
from test_image import image_config, image_task


# -- collapse --------------------------------------------------------------------------------------------------
def test_prediction_summary_matches_a_count_by_hand():
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    predicted = torch.tensor([0, 1, 0, 1, 1, 1, 1, 2, 1, 1])
    confusion = confusion_counts(predicted, labels, 4)
    dense = np.zeros((4, 4), dtype=int)
    for t, p in zip(labels.tolist(), predicted.tolist()):
        dense[t, p] += 1
    assert np.array_equal(confusion.numpy(), dense)
    s = prediction_summary(confusion, ["a", "b", "c", "d"])
    assert (s["top_class"], s["top_label"], s["top_share"]) == (1, "b", 0.7)
    assert s["recall"] == [2 / 3, 1.0, 0.2, None]  # class d has no test example
    assert s["majority_share"] == 0.5


def test_collapse_needs_the_threshold_share_and_records_first_and_last_rounds():
    def row(rnd, share):
        return {"round": rnd, "accuracy": 0.3, "predictions": {"top_class": 2, "top_label": "c", "top_share": share,
                                                               "recall": [0, 0, 1], "majority_share": 0.4}}
    assert collapse_of(row(1, COLLAPSE_SHARE - 1e-9)) is None
    assert collapse_of(row(1, COLLAPSE_SHARE))["top_label"] == "c"
    history = [row(1, 0.5), {"round": 2, "train_loss": 1.0}, row(3, 0.97), row(4, 0.6)]
    got = run_collapse(history)
    assert (got["round"], got["rounds"], got["at_end"]) == (3, [3], False)
    assert run_collapse(history[:2]) is None


def image_run(lines: list[str], rounds: int = 2, forced: int | None = None, **run) -> Simulation:
    """FedIT on the synthetic bands (learnable in two rounds at this rate); ``forced``: the global head's bias made
    to favour that class by 100, so that every model predicts it."""
    d = image_config("fedit", rounds=rounds).to_dict()
    d["train"].update(lr=1e-2, local_steps=5)
    d["run"].update(run)
    sim = Simulation(from_dict(d), task=image_task(), log=lines.append)
    if forced is not None:
        sim.server["head/classifier.bias"][forced] += 100.0
    sim.run()
    return sim


def test_a_run_forced_to_predict_one_class_says_so_in_one_line():
    lines: list[str] = []
    sim = image_run(lines, forced=2)
    said = [line for line in lines if "collapse:" in line]
    assert len(said) == 1 and "round 1:" in said[0] and "'band2'" in said[0] and "100.0 %" in said[0]
    assert sim.summary()["collapse"]["top_class"] == 2 and sim.summary()["collapse"]["at_end"]
    assert sim.history[0]["predictions"]["recall"] == [0.0, 0.0, 1.0]


def test_a_healthy_run_says_nothing_of_a_collapse():
    lines: list[str] = []
    sim = image_run(lines, eval_every=2)
    assert sim.history[-1]["accuracy"] > 0.9
    assert not [line for line in lines if "collapse" in line] and "collapse" not in sim.summary()
