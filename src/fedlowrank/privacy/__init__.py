"""Privacy as one runtime feature every method can use (``[privacy]`` config section; ``docs/privacy.md``).

* :mod:`.mechanisms` — the update of a reply (delta from what was received), its clipping and Gaussian noise;
* :mod:`.runtime` — the hooks both runtimes call: local DP on the client, central DP before ``aggregate``, and
  the per-round (ε, δ) accounting;
* :mod:`.accountant` — RDP of the Poisson-subsampled Gaussian, (ε, δ), target ε → σ;
* :mod:`.dpsgd` — record-level DP-SGD inside local training (per-example gradients with ``torch.func``);
* :mod:`.settings` — the config section and its checks.
"""
