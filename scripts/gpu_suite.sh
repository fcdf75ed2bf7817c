#!/usr/bin/env bash
# One GPU session's worth of checks and benchmarks, in priority order:
#   bash scripts/gpu_suite.sh OUTDIR [STAGES]     (STAGES: comma list, default all)
# Logs and JSON land in OUTDIR. Each stage has its own time limit so one slow stage
# (e.g. Triton autotuning on a fresh machine) cannot eat the others.
set -u
OUT=${1:?usage: gpu_suite.sh OUTDIR [STAGES]}
STAGES=",${2:-gpu_check,train_cuda,bench_pipeline,bench_moe_ep2,bench_kda},"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ echo "gpus: $NGPU"; nvidia-smi --query-gpu=name,memory.total --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > "$OUT/env.txt" 2>&1

stage() { local name=$1 limit=$2; shift 2; [[ $STAGES == *",$name,"* ]] || return 0; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -3 "$OUT/$name.log"; }

stage gpu_check 90 python3 scripts/gpu_check.py --json "$OUT/gpu_check.json"
stage train_cuda 80 python3 -m k3train train --config configs/k3_tiny.yaml --run-dir /tmp/run_tiny \
  train.device=cuda train.steps=150 train.micro_batch_size=32 train.seq_len=256 logging.progress_bar=false
cp /tmp/run_tiny/metrics.jsonl "$OUT/train_cuda_metrics.jsonl" 2>/dev/null
if [ "$NGPU" -ge 2 ]; then
  stage bench_pipeline 110 torchrun --standalone --nproc-per-node 2 scripts/bench/bench_pipeline.py \
    --vpp 1,2 --steps 5 --json "$OUT/bench_pipeline.json"
  stage bench_moe_ep2 60 torchrun --standalone --nproc-per-node 2 scripts/bench/bench_moe_dispatch.py
fi
stage bench_kda 140 python3 scripts/bench/bench_kda_layer.py --json "$OUT/bench_kda.json"
