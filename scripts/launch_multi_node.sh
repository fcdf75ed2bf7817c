#!/usr/bin/env bash
# Run the same command on every node; rendezvous comes from the environment:
#   NNODES       number of nodes                       (required)
#   NODE_RANK    this node's index, 0..NNODES-1        (required)
#   MASTER_ADDR  address of node 0                     (required)
#   MASTER_PORT  free TCP port on node 0               (default 29500)
#   NPROC_PER_NODE processes (GPUs) per node           (default 8)
#   MAX_RESTARTS torchrun restarts after a failure     (default 0; pass --resume with it)
#   RDZV_ID      rendezvous id                         (default k3train)
# Exit status: this node's workers' (0 after a clean SIGTERM save), via scripts/run_torchrun.sh.
#   scripts/launch_multi_node.sh CONFIG [--run-dir DIR] [--resume] [key.sub=value ...]
# Network settings (NCCL_IB_DISABLE, NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) depend on the cluster and
# are left to you: export them before calling this script.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: NNODES=.. NODE_RANK=.. MASTER_ADDR=.. $0 CONFIG [--run-dir DIR] [key.sub=value ...]" >&2
  exit 2
fi
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
CONFIG=$1
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A rank that dies makes the others raise instead of hanging in a collective until the timeout.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
exec "$(dirname "$0")/run_torchrun.sh" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --rdzv-id "${RDZV_ID:-k3train}" ${MAX_RESTARTS:+--max-restarts "$MAX_RESTARTS"} -- train --config "$CONFIG" "$@"
