#!/usr/bin/env bash
# torchrun for k3train, exiting with the workers' outcome (what SLURM requeue logic needs):
#   scripts/run_torchrun.sh TORCHRUN_OPTIONS... -- K3TRAIN_ARGS...
# e.g. scripts/run_torchrun.sh --standalone --nproc-per-node 2 -- train --config configs/k3_tiny.yaml
#
# torchrun exits 1 whenever it received a signal (it raises its own SignalException), even when
# every worker finished its step, saved a checkpoint and exited 0, as k3train's workers do on
# SIGTERM. So each worker runs under scripts/worker_exit_status.sh, which records its exit
# status; when a signal stopped the run and every worker that started on this node exited 0,
# this script exits 0. Any other outcome passes torchrun's status through (non-zero).
# Signals reaching this script go to torchrun, which forwards them to the workers; k3train
# treats repeats of one stop request (SLURM signals every process of a step) as one.
# torchrun runs through scripts/torchrun_stop_once.py, whose agent acts on its first stop
# signal only: the agent often gets one request twice (its own copy from SLURM or the process
# group, and this script's), and torchrun's own agent, signalled again while it stops the
# workers, starts its shutdown a second time (it hung so in CI). This script cannot tell
# whether torchrun already got the signal, so it forwards every one it gets.
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (default here 300 s; torchrun's own default is 30 s): how
# long torchrun lets signalled workers finish their step and save before it SIGKILLs them.
set -u
opts=()
while [[ $# -gt 0 && $1 != -- ]]; do opts+=("$1"); shift; done
if [[ $# -lt 2 ]]; then
  echo "usage: $0 TORCHRUN_OPTIONS... -- K3TRAIN_ARGS..." >&2
  exit 2
fi
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
status_dir=$(mktemp -d "${TMPDIR:-/tmp}/k3train-workers.XXXXXX")
trap 'rm -rf "$status_dir"' EXIT
export K3TRAIN_WORKER_STATUS_DIR=$status_dir
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
. "$here/forward_signals.sh"
forward_signals_run "${PYTHON:-python3}" "$here/torchrun_stop_once.py" ${opts[@]+"${opts[@]}"} --no-python bash "$here/worker_exit_status.sh" \
  "${PYTHON:-python3}" -m k3train "$@"
rc=$FORWARDED_RC
if [[ $rc -ne 0 && $FORWARDED_SIGNAL -eq 1 ]]; then
  started=$(find "$status_dir" -name 'rank_*.started' | wc -l)
  clean=$(grep -lx 0 "$status_dir"/rank_*.status 2>/dev/null | wc -l)
  if [[ $started -gt 0 && $clean -eq $started ]]; then
    echo "[k3train] stopped by a signal: all $started workers on this node saved and exited 0" \
         "(torchrun's own status $rc reflects only that it was signalled)" >&2
    exit 0
  fi
fi
exit "$rc"
