#!/usr/bin/env bash
# The prepared GPU check: run on the lent machine through the device tool, e.g.
#   run(command="bash scripts/gpu_check.sh $OUT", carry=[".whl"], timeout_s=540)
# It uses what that machine has installed (jax with CUDA, flax, optax, orbax, chex, safetensors) plus the wheels
# scripts/fetch_gpu_wheels.sh downloaded here into .whl/ (tokamax; without .whl/ the tokamax rows are absent);
# nothing is fetched there. Results: $OUT/gpu_check.json and $OUT/gpu_check.txt (partial results survive a timeout).
set -euo pipefail
out="${1:?usage: scripts/gpu_check.sh OUT_DIR [gpu_check.py options]}"
shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out.nvidia-smi.txt" || true
mkdir -p "$out"
[ -f "$out.nvidia-smi.txt" ] && mv "$out.nvidia-smi.txt" "$out/nvidia-smi.txt"
python="${PYTHON:-python3}"  # the GPU image's packages live in its python3 (KINDS.md of the device tool)
# Wheels carried from here (scripts/fetch_gpu_wheels.sh; run with carry=[".whl"]): tokamax and what it needs.
# A failed install is reported and the check runs without them (the tokamax rows are then absent), rather
# than losing the lent machine's minutes.
if compgen -G ".whl/*.whl" > /dev/null; then
  if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: installing the carried wheels failed; running without them" >&2
  fi
fi
timeout 480 "$python" scripts/gpu_check.py "$out" "$@"
