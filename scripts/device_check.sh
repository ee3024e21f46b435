#!/usr/bin/env bash
# The device check on the lent GPU machine as it is (scripts/device_check.py's header says how to prepare it):
#   the device tool's run, carry [".whl", "models/arith-tiny"], timeout_s 590, command: bash scripts/device_check.sh
# Installs the carried wheels (.whl/, made by `python scripts/device_check.py --wheels .whl`) beside the machine's
# own packages, runs every check within BUDGET seconds (default 540), and leaves in $OUT the report
# (device_check.json) and every check's log and figures (device_check.tar.gz). Extra arguments go to the script.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WORK="${DEVICE_CHECK_DIR:-/tmp/device-check}"
DEST="${OUT:-runs/device-check-out}"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_check.sh: the wheels in .whl did not install" >&2; exit 2; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
status=0
"$PY" scripts/device_check.py --out "$WORK" --budget "${BUDGET:-540}" --site /tmp/site "$@" || status=$?
DEST="$(mkdir -p "$DEST" && cd "$DEST" && pwd)"
cp "$WORK/device_check.json" "$DEST/" 2>/dev/null || true
(cd "$WORK" && tar -czf "$DEST/device_check.tar.gz" ./*.json ./*.log ./*.xml ./*.yaml 2>/dev/null) || true
exit "$status"
