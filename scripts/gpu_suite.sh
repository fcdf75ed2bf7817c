#!/usr/bin/env bash
# One GPU session's worth of checks and benchmarks (used through the lent H200 machines):
#   bash scripts/gpu_suite.sh OUTDIR [steps]
# Logs and JSON land in OUTDIR. Each stage has its own time limit so one slow stage
# (e.g. Triton autotuning on a fresh machine) cannot eat the others.
set -u
OUT=${1:?usage: gpu_suite.sh OUTDIR}
STEPS=${2:-150}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "gpus: $NGPU" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/env.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/env.txt" 2>&1

stage() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -4 "$OUT/$name.log"; }

stage gpu_check 240 python3 scripts/gpu_check.py --json "$OUT/gpu_check.json"
stage train_cuda 300 python3 -m k3train train --config configs/k3_tiny.yaml --run-dir "$OUT/run_tiny" \
  train.device=cuda train.steps="$STEPS" train.micro_batch_size=32 train.seq_len=256 logging.progress_bar=false
cp "$OUT/run_tiny/metrics.jsonl" "$OUT/train_cuda_metrics.jsonl" 2>/dev/null
stage bench_kda 300 python3 scripts/bench/bench_kda_layer.py --json "$OUT/bench_kda.json"
if [ "$NGPU" -ge 2 ]; then
  stage bench_moe_ep2 200 torchrun --standalone --nproc-per-node 2 scripts/bench/bench_moe_dispatch.py
fi
