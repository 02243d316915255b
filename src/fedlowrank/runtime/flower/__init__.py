"""Run any fedlowrank method on Flower (``pip install fedlowrank[flower]``; flwr 1.41).

* :mod:`.strategy` — :class:`MethodStrategy`, a ``flwr.serverapp.strategy.Strategy`` driving any method;
* :mod:`.server_app` / :mod:`.client_app` — the ``ServerApp`` and ``ClientApp`` (``app`` objects) that
  ``examples/flower_app/pyproject.toml`` names as its components;
* :mod:`.records` — fedlowrank Message/State <-> Flower records;
* :mod:`.settings` — Flower run config -> fedlowrank config.

See ``docs/flower.md``.
"""
