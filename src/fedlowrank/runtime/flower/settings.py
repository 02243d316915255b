"""How a Flower run config maps to a fedlowrank :class:`~fedlowrank.config.RunConfig`.

Flower's run config is flat (``[tool.flwr.app.config]`` in the app's ``pyproject.toml``, overridden with
``flwr run --run-config 'k=v ...'``) and only accepts keys the app declares. The mapping:

* ``config`` — the fedlowrank TOML file (absolute path) or bundled config name (``tiny``, ``main``);
  ``""`` = the defaults;
* ``section.key`` (e.g. ``method.name``, ``run.rounds``, ``lora.rank``) — exactly ``--set section.key=value``;
  the value ``""`` means *not set* (the TOML's value stays), so that declaring a key never shadows the file;
* ``set`` — any further overrides, space separated, in ``--set`` syntax (``"method.mu=0.1 lora.ranks=[2,4]"``),
  for keys the app does not declare; applied last;
* ``flower.*`` — options of the Flower runtime itself (:class:`FlowerSettings`).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, fields
from typing import Mapping

from ...config import ConfigError, RunConfig, load_config


@dataclass
class FlowerSettings:
    """Options of the Flower runtime (run-config keys ``flower.<name with hyphens>``).

    Attributes:
        round_timeout: seconds the server waits for a round's replies; clients that have not replied by
            then are counted as dropped (the round goes on if ``run.min_replies`` replies arrived).
        node_timeout: seconds the server waits at the start for a SuperNode per client
            (``partition.num_clients``); the run starts with the nodes present after that.
        run_dir: where the ServerApp writes the run directory; ``""`` = ``run.out_dir/<run.name>-flower-<run id>``.
        overwrite: replace the run in a non-empty run directory (``fedlowrank run --overwrite``).
        secagg: aggregate with Flower's SecAgg+ (:mod:`.secagg`): the server learns only the mean update.
        secagg_clipping_range: SecAgg+'s quantisation range: each update coordinate is clipped to
            ``[-range, range]`` and quantised in steps of ``2·range/2²²``.
    """

    round_timeout: float = 600.0
    node_timeout: float = 120.0
    run_dir: str = ""
    overwrite: bool = False
    secagg: bool = False
    secagg_clipping_range: float = 8.0


def _key(name: str) -> str:
    return "flower." + name.replace("_", "-")


def _as_override(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, str) else repr(value)


def load_run_config(run_config: Mapping[str, bool | int | float | str]) -> tuple[RunConfig, FlowerSettings]:
    """The validated fedlowrank config and the Flower settings of a Flower run config."""
    settings = FlowerSettings()
    known = {_key(f.name): f for f in fields(FlowerSettings)}
    overrides: list[str] = []
    for key, value in run_config.items():
        if key in ("config", "set"):
            continue
        if key.startswith("flower."):
            if key not in known:
                raise ConfigError(f"{key} is not a Flower runtime option; allowed: {', '.join(sorted(known))}")
            f = known[key]
            if isinstance(f.default, bool):
                if str(value).lower() not in ("true", "false"):
                    raise ConfigError(f"{key} must be true or false, got {value!r}")
                value = str(value).lower() == "true"
            try:
                setattr(settings, f.name, type(f.default)(value))
            except ValueError:
                raise ConfigError(f"{key} must be a {type(f.default).__name__}, got {value!r}") from None
            continue
        if value != "":
            overrides.append(f"{key}={_as_override(value)}")
    try:
        overrides += shlex.split(str(run_config.get("set", "")))
    except ValueError as exc:
        raise ConfigError(f"run config key set: {exc} in {run_config.get('set')!r}") from None
    if settings.round_timeout <= 0 or settings.node_timeout < 0:
        raise ConfigError("flower.round-timeout must be > 0 and flower.node-timeout >= 0")
    try:
        cfg = load_config(str(run_config.get("config", "")) or None, overrides)
    except ConfigError as exc:  # names the fedlowrank key, which is the run config's key (or is in its `set`)
        raise ConfigError(f"Flower run config: {exc}") from None
    if settings.secagg:
        check_secagg(cfg, settings)
    return cfg, settings


def check_secagg(cfg: RunConfig, settings: FlowerSettings) -> None:
    """Refuse (one line) a run that SecAgg+ cannot carry."""
    from ...methods import method_class

    cls = method_class(cfg.method_name)
    if "central" not in cls.supported_privacy_modes():
        why = ("its server step needs individual replies (needs_individual_replies)" if cls.needs_individual_replies
               else cls.privacy_refusal)
        raise ConfigError(f"flower.secagg: method {cls.name!r} cannot run under secure aggregation: {why}")
    if cfg.server.weighting != "uniform":
        raise ConfigError("flower.secagg needs server.weighting = 'uniform' (SecAgg+ gives the server the plain mean)")
    if cfg.privacy.mode == "central":
        raise ConfigError("flower.secagg with privacy.mode = 'central': the server cannot clip replies it cannot see; "
                          "use privacy.mode = 'local'")
    if cfg.server.aggregate != "mean" or math.isfinite(cfg.server.update_clip):
        raise ConfigError("flower.secagg with server.aggregate or server.update_clip: the server sees only the mean "
                          "update, not the replies these bound; use server.aggregate = 'mean' and "
                          "server.update_clip = inf")
    if cfg.run.clients_per_round < 2:
        raise ConfigError("flower.secagg needs run.clients_per_round >= 2")
    if cfg.uplink.active:
        raise ConfigError(f"flower.secagg with uplink.codec = {cfg.uplink.codec!r}, uplink.lossless = "
                          f"{cfg.uplink.lossless!r}: SecAgg+ masks the plain update in its integer field and unmasks "
                          f"only the sum, which a coded reply does not survive; leave [uplink] unset (SecAgg+ quantises "
                          f"the update itself, to flower.secagg-clipping-range) or run without flower.secagg "
                          f"(downlink codecs work with it)")
    if settings.secagg_clipping_range <= 0:
        raise ConfigError(f"flower.secagg-clipping-range must be > 0, got {settings.secagg_clipping_range}")
