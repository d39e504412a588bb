# Two commands do everything on a fresh machine: `make demo` and `make test`.
# The virtual environment is created on first use; torch==2.13.0 is installed first on machines without an NVIDIA
# GPU so that pip never pulls the multi-GB CUDA build (GPU users install their own CUDA torch, or set TORCH_SPEC).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo compare test test-slow test-all lint format venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml benchmarks/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing the package's torch requirement as pip resolves it (CUDA build)"; \
	else \
		echo "no NVIDIA GPU: installing the CPU build $(TORCH_SPEC) first"; \
		$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet -e ./benchmarks  # `noloco-node bench` and the tests' hostile clients
	touch $(STAMP)

# The main job on the embedded default: a bootstrap peer and 4 node processes on 127.0.0.1 training the tiny model
# on the Python standard library's sources, pairing through the DHT and blending over gRPC. About a minute.
demo: $(STAMP)
	$(BIN)/noloco-node swarm --nodes 4 --out runs/demo

# The algorithm study: 8 in-process replicas, NoLoCo against DiLoCo (heavy-ball and Nesterov), DDP and solo.
# About 6 minutes on 2 CPU cores.
compare: $(STAMP)
	$(BIN)/noloco-node simulate --compare --replicas 8 --model tiny --diloco-inner-steps 50 --out runs/compare

lint: $(STAMP)
	$(BIN)/ruff check noloco_node benchmarks tests
	$(BIN)/ruff format --check noloco_node benchmarks tests
	$(BIN)/mypy noloco_node benchmarks/noloco_bench
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format noloco_node benchmarks tests
	$(BIN)/ruff check --fix noloco_node benchmarks tests

# The fast tier: unit tests plus integration tests that start real processes. pytest exits 5 when it collects no
# tests, which fails this target like any other error.
test: lint
	$(BIN)/python -m pytest -m "not slow" --durations=15 $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

test-all: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info benchmarks/*.egg-info
