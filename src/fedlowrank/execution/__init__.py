"""How training steps execute, beside where tensors live (:mod:`fedlowrank.device`): compiled steps
(:mod:`.compiling`) and what a step costs, measured (:mod:`.measure`: profiler ranges, dispatched operations,
host-device moves, allocated bytes)."""
