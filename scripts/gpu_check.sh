#!/usr/bin/env bash
# One-GPU check of the real-model path (docs/real_models.md), on a machine with one NVIDIA GPU.
# Order: 1. `make setup-gpu` once, where the package index can be reached (CUDA vLLM and its torch);
#        2. `bash scripts/gpu_check.sh [OUT_DIR]`: needs no internet (random model, shipped data).
# It builds a small tied-embedding Qwen2-layout model, runs `coba run` for 3 steps with vLLM on CUDA
# and rollout.sleep_during_update on, then checks every step's tables, the weight version of the
# rollouts, the GPU memory freed while the update ran, and an in-place weight reload against
# transformers. One line per check; exit status 1 when a check failed. About 3-6 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-runs/gpu-check}}"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "no .venv: run 'make setup-gpu' first" >&2
  exit 2
fi
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || echo "nvidia-smi not found" >&2
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"
status=0
timeout 470 "$PY" scripts/gpu_check.py --out "$OUT_DIR" "${@:2}" || status=$?
nvidia-smi --query-gpu=memory.used --format=csv,noheader || true
exit "$status"
