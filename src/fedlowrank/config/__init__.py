"""Run configuration: TOML files plus ``--set section.key=value`` overrides, checked before any work.

Sections: ``[run]``, ``[task]``, ``[data]``, ``[partition]``, ``[lora]``, ``[train]``, ``[server]``, ``[method]``
(``name`` plus the method's own options), ``[compare]``, ``[privacy]``, ``[uplink]`` and ``[downlink]``; code reads ``cfg.<section>.<key>``,
``cfg.method_name`` and ``cfg.method_options``. A wrong value raises :class:`ConfigError`, one line naming the
field and what is allowed.

Every key is ONE declaration (:mod:`fedlowrank.schema`): validation, ``fedlowrank config``, docs/configuration.md
(``fedlowrank config --markdown``) and the errors read it. Where each is declared:

* ``[run]``, ``[task]``, ``[data]``, ``[lora]``, ``[server]``, ``[compare]``: :mod:`.sections`;
* ``[train]``: :class:`fedlowrank.training.local.TrainConfig`; ``[partition]``:
  :class:`fedlowrank.tasks.partition.PartitionConfig`; ``[privacy]``: :class:`fedlowrank.privacy.settings.PrivacySection`;
  ``[uplink]``, ``[downlink]``: :mod:`fedlowrank.codecs.settings`;
* ``method.*``: the method's dataclass fields (:mod:`fedlowrank.methods`); ``task.options.*``: the task's
  ``Options`` (:mod:`fedlowrank.tasks`).

Adding a key is one line in its section's dataclass::

    gradient_checkpointing: bool = setting(False, "recompute activations in the backward pass (less memory)")
    compile: bool = setting(False, "torch.compile the model")
    gpu_memory_fraction: float = setting(0.0, "share of the GPU's memory a run may take (0 = no limit)", ge=0, le=1)

(type = the annotation; ``choices=``, ``ge``/``gt``/``le``/``lt`` with a ``reason`` for a machine's or model's
limit, ``allow_inf``, or ``check=`` with ``form=`` for a rule of its own). A rule between keys goes in
:func:`~.checks.validate` and names every field it relates. A key added in the older style (a plain dataclass
field, a ``MEANINGS`` entry and a check in ``validate``) is ported by writing the field as above with the
``MEANINGS`` text as its meaning and the check's bounds or choices as arguments, then deleting the entry and the
check (or keeping the check in ``validate`` when it relates several keys). A test walks every key and refuses one
without a type and meaning.
"""

from ..configs import bundled_configs
from ..schema import ConfigError
from .checks import check_writable, validate
from .load import from_dict, load_config, parse_override, read_toml
from .sections import (MEANINGS, SECTIONS, CompareSection, DataSection, LoRASection, RunConfig, RunSection,
                       ServerSection, TaskSection, check_model, config_keys, config_rows)

__all__ = ["ConfigError", "CompareSection", "DataSection", "LoRASection", "MEANINGS", "RunConfig", "RunSection",
           "SECTIONS", "ServerSection", "TaskSection", "bundled_configs", "check_model", "check_writable",
           "config_keys", "config_rows", "from_dict", "load_config", "parse_override", "read_toml", "validate"]
