#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("Filling the GPU"), in one run on a machine with an NVIDIA GPU: `bench
# train` at the node's own plan beside the eager, unplanned step, for 125m and 1.3b, with the embedded corpus's
# 256-token vocabulary and with a 32k one. Each report is written to $OUT (default runs/gpu-figures).
# Usage: bash benchmarks/gpu/figures.sh [steps]
set -uo pipefail
OUT=${OUT:-runs/gpu-figures}
STEPS=${1:-6}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
for run in "125m 256" "125m 32000" "1.3b 256" "1.3b 32000"; do
    set -- $run
    echo "== bench train --model $1 --vocab-size $2"
    python3 - "$1" "$2" "$STEPS" <<'PY' 2>&1 | tee "$OUT/train-$1-$2.txt"
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
from noloco_bench.train import run_train_bench
started = time.perf_counter()
result = run_train_bench(sys.argv[1], vocab_size=int(sys.argv[2]), steps=int(sys.argv[3]), warmup=2)
print(result.report())
print(f"wall {time.perf_counter() - started:.0f} s")
PY
done
