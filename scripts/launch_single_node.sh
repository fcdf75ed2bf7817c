#!/usr/bin/env bash
# One node, N processes (one per GPU; on CPU, gloo processes).
#   scripts/launch_single_node.sh NPROC CONFIG [--run-dir DIR] [--resume] [key.sub=value ...]
# e.g. scripts/launch_single_node.sh 8 configs/k3_mini.yaml --run-dir runs/mini parallel.tp=2
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 NPROC CONFIG [--run-dir DIR] [--resume] [key.sub=value ...]" >&2
  exit 2
fi
NPROC=$1
CONFIG=$2
shift 2
# One thread per process by default: N processes x all cores oversubscribes the CPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
exec torchrun --standalone --nproc-per-node "$NPROC" -m k3train train --config "$CONFIG" "$@"
