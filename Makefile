# Quick start:  make demo   (set up .venv, run the main comparison on BBC News + MiniLM)
#               make test   (set up .venv, run the test suite)
.PHONY: setup demo test
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/fedlowrank compare main
test: setup
	.venv/bin/python -m pytest
