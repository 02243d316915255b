"""A minimal causal-LM task for unit tests of the methods on LLaMA/GPT-2 shapes: next-token cross-entropy on a
fixed matrix of random token ids, with the model loaded by :func:`fedlowrank.models.loading.load_model`.

It is not the library's causal-LM task (data, chat template, label masking live there); it only gives every
method a causal LM with non-square targets to train.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn

from fedlowrank.adapters.model import AdaptedModel
from fedlowrank.adapters.targets import default_targets, resolve_targets
from fedlowrank.config import load_config
from fedlowrank.device import module_device, to_device
from fedlowrank.models.loading import load_model
from fedlowrank.tasks.base import Task

SGD_ONLY = ("ssf", "fedsub")  # methods defined with plain SGD local steps


class RandomTokensLM(Task):
    """``num_train`` training rows and 8 test rows of ``length`` random ids (seeded); loss = LM cross-entropy."""

    name = "random-tokens-lm"

    def __init__(self, model: str = "tiny-llama", targets: list[str] | None = None, num_train: int = 48,
                 length: int = 12, seed: int = 0):
        self.loaded = load_model(model, "causal-lm")
        self.targets = targets
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(3, len(self.loaded.tokenizer), (num_train + 8, length), generator=g)
        self._num_train = num_train

    @property
    def num_train(self) -> int:
        return self._num_train

    def build_model(self) -> AdaptedModel:
        import copy

        net = copy.deepcopy(self.loaded.net).eval()
        names = resolve_targets(net, self.targets or default_targets(self.loaded.model_type),
                                self.loaded.output_modules)
        return AdaptedModel(net, names, [])

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[torch.as_tensor(np.asarray(indices), dtype=torch.long)]}

    def loss(self, net: nn.Module, batch) -> torch.Tensor:
        return net(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def features(self, net: nn.Module, batch) -> torch.Tensor:
        out = net(input_ids=batch["input_ids"], output_hidden_states=True)
        return out.hidden_states[-1].mean(1)

    @torch.no_grad()
    def evaluate(self, net: nn.Module) -> dict[str, float]:
        net.eval()
        batch = to_device(self.batch(np.arange(self._num_train, self._num_train + 8)), module_device(net))
        return {"loss": float(self.loss(net, batch))}


@lru_cache(maxsize=None)
def lm_task(model: str = "tiny-llama", targets: tuple[str, ...] | None = None) -> RandomTokensLM:
    return RandomTokensLM(model, list(targets) if targets else None)


def lm_config(method: str, *sets: str):
    """The ``tiny`` config turned to the random-token LM: iid over 4 clients, one round, the method's needs."""
    extra = ("train.optimizer=sgd",) if method in SGD_ONLY else ()
    return load_config("tiny", [f"method.name={method}", "partition.kind=iid", "run.rounds=1", "run.device=cpu",
                                *extra, *sets])
