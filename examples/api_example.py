"""Scripting fedlowrank: one run, then a small comparison, on the bundled `tiny` config (seconds on a CPU).

    python examples/api_example.py
"""

import fedlowrank

print("fedlowrank", fedlowrank.__version__)

# One method, two rounds; nothing is written unless `out` is given.
summary = fedlowrank.run("tiny", ["method.name=florg", "run.rounds=2"])
print(f"FLoRG: accuracy {summary['accuracy']:.3f} after {summary['rounds']} rounds, "
      f"{summary['bytes_up'] / 1e3:.1f} KB up")

# Two methods on the same partition and budget, two seeds: means with 95% intervals, paired differences.
results = fedlowrank.compare("tiny", methods=["fedit", "florg"], seeds=[0, 1])
for row in results["rows"]:
    print(row["method"], "final", results["metric"], "per seed:", [run["final"] for run in row["runs"]])
for diff in results["paired"]:
    print(diff["method"], "-", diff["reference"], ":", diff["final"]["verdict"])

# Bad input fails before any work, naming the field.
try:
    fedlowrank.run("tiny", ["train.weight_decay=-1"])
except fedlowrank.ConfigError as exc:
    print("refused:", exc)
