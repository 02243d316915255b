# Quick start:  make demo   (set up .venv, run the main comparison on BBC News + MiniLM)
#               make test   (set up .venv, run the test suite; the few tests that need AG News or GSM8K read
#                            $FEDLOWRANK_DATA/{agnews,gsm8k} or the datasets cache and skip without them)
.PHONY: setup demo test
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/fedlowrank compare main
test: setup
	.venv/bin/python -m pytest
