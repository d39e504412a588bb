#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("Filling the GPU") in one run on a machine with an NVIDIA GPU, without
# installing the package (PYTHONPATH): the same functions as `noloco-node bench train` and `bench outer-step`.
#   train: bench train at the node's own plan beside the eager, unplanned step, 125m and 1.3b, vocabularies of 256
#          and 32,000;
#   outer: bench outer-step at 1.3b and 125m (H = 50): the outer step and its upkeep as a share of the phase;
#   solo:  `noloco-node train` of 125m on the embedded corpus for 3 outer steps (the plan, evaluation, checkpoints).
# Usage: bash benchmarks/gpu/figures.sh [train] [outer] [solo]     (default: all three). Reports go to $OUT.
set -uo pipefail
OUT=${OUT:-runs/gpu-figures}
PARTS=${*:-train outer solo}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
LOGGING='import logging; logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")'
for part in $PARTS; do
  case $part in
  train)
    for run in "125m 256" "125m 32000" "1.3b 256" "1.3b 32000"; do
      set -- $run
      echo "== bench train --model $1 --vocab-size $2"
      python3 -c "$LOGGING
from noloco_bench.train import run_train_bench
print(run_train_bench('$1', vocab_size=$2, steps=6, warmup=2).report())" 2>&1 | tee "$OUT/train-$1-$2.txt"
    done ;;
  outer)
    for size in 1.3b 125m; do
      echo "== bench outer-step --model $size"
      python3 -c "$LOGGING
from noloco_bench.outer_step import run_outer_step_bench
print(run_outer_step_bench('$size').report())" 2>&1 | tee "$OUT/outer-$size.txt"
    done ;;
  solo)
    echo "== train --model 125m --batch-size 64 --seq-len 1024 --steps 30 --inner-steps 10"
    python3 -c "$LOGGING
from pathlib import Path
from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig
from noloco_node.training.solo import run_training
train = TrainConfig(model_size='125m', batch_size=64, seq_len=1024, total_steps=30, inner_steps=10, lr=1e-3)
replica = run_training(train, OuterConfig(), DataConfig(), checkpoint_dir=Path('$OUT/solo'), checkpoint_every=10)
print('solo run finished at inner step', replica.inner_step, 'outer step', replica.outer_step)" 2>&1 \
      | tee "$OUT/solo.txt"
    rm -rf "$OUT/solo" ;;
  esac
done
