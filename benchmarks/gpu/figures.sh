#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("Filling the GPU") in one run on a machine with an NVIDIA GPU, without
# installing the package (PYTHONPATH): the same functions as `noloco-node bench train` and `bench outer-step`.
#   train: bench train at the node's own plan beside the eager, unplanned step, 125m and 1.3b, vocabularies of 256
#          and 32,000;
#   outer: bench outer-step at 1.3b and 125m (OUTER_SIZES; H = 50): the outer step and its upkeep as a share of the
#          phase, with the outer state on the GPU and on the host;
#   solo:  `noloco-node train` of 125m on the embedded corpus for 3 outer steps (the plan, evaluation, checkpoints).
#   check: the unit tests of the step plan and the outer state's placements (the one that needs a GPU runs here);
#   swarm: `noloco-node swarm --nodes 2` on the one GPU at H = 50 (SWARM_MODEL, default 125m; SWARM_BATCH x 1,024
#          tokens, default 128, micro-batch SWARM_MICRO, default 32: two probes at once would each plan for the
#          whole card; SWARM_STEPS inner steps, default 150, cut at SWARM_LIMIT seconds, default 3600): the outer
#          step and its upkeep from the nodes' histories, and the nodes' peak host memory (the largest node's
#          and the machine's in use); SWARM_CHECKPOINT_EVERY outer steps between checkpoints (default 1).
#   memory: one `join` node alone (MEMORY_MODEL, default 1.3b; 16 x 1,024 tokens a step, H = 5, 15 steps, compile
#          off) with its /proc/PID/status (VmRSS, RssAnon, RssFile, RssShmem: pinned memory) every 2 s, in MiB.
# Usage: bash benchmarks/gpu/figures.sh [train] [outer] [solo] [check] [swarm] [memory]   (default: the first three).
# Reports go to $OUT.
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
    for size in ${OUTER_SIZES:-1.3b 125m}; do
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
  check)
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_step_plan.py -k "outer or compiled" 2>&1 \
      | grep -v "^DEBUG" | tee "$OUT/check.txt" ;;
  swarm)
    model=${SWARM_MODEL:-125m} batch=${SWARM_BATCH:-128} micro=${SWARM_MICRO:-32} runs=${SWARM_DIR:-/tmp/swarm}
    steps=${SWARM_STEPS:-150}
    echo "== swarm --nodes 2 --model $model --batch-size $batch --micro-batch $micro --seq-len 1024 --inner-steps 50 --steps $steps"
    (while sleep 2; do ps -C python3 -o rss=,args= | grep -- " join " | awk '{print $1}' | sort -n | tail -1;
      free -k | awk '/^Mem:/ {print $3}' >> "$runs.used"; done > "$runs.rss") &
    sampler=$!
    NOLOCO_NODE__CHECKPOINT_EVERY=${SWARM_CHECKPOINT_EVERY:-1} timeout "${SWARM_LIMIT:-3600}" python3 -m noloco_node swarm --nodes 2 --model "$model" --batch-size "$batch" \
      --micro-batch "$micro" --seq-len 1024 --inner-steps 50 --steps "$steps" --lr 1e-3 --out "$runs" 2>&1 \
      | tail -20 | tee "$OUT/swarm-$model.txt"
    kill $sampler
    python3 benchmarks/gpu/outer_share.py "$runs" "$runs.rss" 2>&1 | tee -a "$OUT/swarm-$model.txt"
    echo "machine's peak memory in use: $(sort -n "$runs.used" | tail -1 | awk '{printf "%.1f", $1 / 2^20}') GiB" \
      | tee -a "$OUT/swarm-$model.txt" ;;
  memory)
    model=${MEMORY_MODEL:-1.3b} dir=${MEMORY_DIR:-/tmp/memory-node}
    rm -rf "$dir"
    echo "== join --model $model alone: host memory by the second"
    timeout "${MEMORY_LIMIT:-300}" python3 -m noloco_node join --compile off --data-dir "$dir" --model "$model" \
      --batch-size 16 --micro-batch 8 --seq-len 1024 --inner-steps 5 --steps 15 --wait-for-peers 0 --status-port 0 \
      --log-every 1 > "$OUT/memory-$model.log" 2>&1 &
    sleep 2
    pid=$(pgrep -f "^python3 -m noloco_node join" | head -1)
    while kill -0 "$pid" 2>/dev/null; do
      echo "$(date +%T) $(grep -E '^(VmRSS|RssAnon|RssFile|RssShmem)' /proc/"$pid"/status | awk '{printf "%s %d ", $1, $2/1024}')"
      sleep 2
    done > "$OUT/memory-$model.txt"
    wait
    echo "peak VmRSS (MiB): $(awk '{print $3}' "$OUT/memory-$model.txt" | sort -n | tail -1)" | tee -a "$OUT/memory-$model.txt"
    rm -rf "$dir" ;;
  esac
done
