#!/usr/bin/env bash
# One node, N processes (one per GPU; on CPU, gloo processes).
#   scripts/launch_single_node.sh NPROC CONFIG [--run-dir DIR] [--resume] [key.sub=value ...]
# e.g. scripts/launch_single_node.sh 8 configs/k3_mini.yaml --run-dir runs/mini parallel.tp=2
# MAX_RESTARTS=N: torchrun restarts the workers up to N times after a failure (pass --resume so
# that they continue from the newest checkpoint). Exit status: the workers' (0 after a clean
# SIGTERM save), through scripts/run_torchrun.sh.
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
exec "$(dirname "$0")/run_torchrun.sh" --standalone --nproc-per-node "$NPROC" \
  ${MAX_RESTARTS:+--max-restarts "$MAX_RESTARTS"} -- train --config "$CONFIG" "$@"
