#!/usr/bin/env bash
# A torchrun worker for scripts/run_torchrun.sh: runs the command, forwards SIGTERM/SIGINT to
# it, and records its exit status in $K3TRAIN_WORKER_STATUS_DIR/rank_$RANK.status (torchrun
# itself does not report it once it has been signalled).
set -u
: "${K3TRAIN_WORKER_STATUS_DIR:?run through scripts/run_torchrun.sh}" "${RANK:?run under torchrun}"
out=$K3TRAIN_WORKER_STATUS_DIR/rank_$RANK
rm -f "$out.status"  # a restarted attempt (--max-restarts) reports afresh
: > "$out.started"
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT
wait "$child"
rc=$?
# A trapped signal interrupts wait (status > 128): wait again while the child lives, and once
# more after, for its own status (127: the shell had already reaped it).
while [[ $rc -gt 128 ]] && kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done
if [[ $rc -gt 128 ]]; then wait "$child" 2>/dev/null; again=$?; [[ $again -ne 127 ]] && rc=$again; fi
echo "$rc" > "$out.status"
exit "$rc"
