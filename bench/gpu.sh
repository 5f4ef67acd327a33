#!/usr/bin/env bash
# Runs bench sections on the GPU machine (through the device tool) and leaves results under $OUT.
#   HYBRID_COMMIT=<sha> bash bench/gpu.sh moe:240 ssm:200 models:300 ...
# Each section gets a wall-clock limit (seconds) so a slow one cannot eat the others' time.
set -u
OUT=${OUT:-/tmp/hybrid-bench}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HYBRID_COMMIT=${HYBRID_COMMIT:-unknown}
LOG=$OUT/run.log
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee -a "$LOG"
for spec in "$@"; do
  name=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=300
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$LOG"
  case $name in
    opstest) cmd="python3 -m pytest tests/kernels -q -x -p no:cacheprovider ${PYTEST_K:+-k $PYTEST_K}" ;;
    models)  cmd="python3 bench/models.py --out $OUT/models.json ${MODELS_ARGS:-}" ;;
    *)       cmd="python3 bench/$name.py --out $OUT/$name.json ${BENCH_ARGS:-}" ;;
  esac
  timeout --signal=INT "$limit" $cmd 2>&1 | tee -a "$LOG" | grep -v -E "Warning|warn" | tail -60
  echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$LOG"
done
