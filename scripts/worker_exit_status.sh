#!/usr/bin/env bash
# A torchrun worker for scripts/run_torchrun.sh: runs the command, forwards SIGTERM/SIGINT to
# it, and records its exit status in $K3TRAIN_WORKER_STATUS_DIR/rank_$RANK.status (torchrun
# itself does not report it once it has been signalled).
set -u
: "${K3TRAIN_WORKER_STATUS_DIR:?run through scripts/run_torchrun.sh}" "${RANK:?run under torchrun}"
out=$K3TRAIN_WORKER_STATUS_DIR/rank_$RANK
rm -f "$out.status"  # a restarted attempt (--max-restarts) reports afresh
: > "$out.started"
. "$(dirname "${BASH_SOURCE[0]}")/forward_signals.sh"
forward_signals_run "$@"
rc=$FORWARDED_RC
echo "$rc" > "$out.status"
exit "$rc"
