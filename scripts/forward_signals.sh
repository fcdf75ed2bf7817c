# Sourced by run_torchrun.sh and worker_exit_status.sh: run a command in the background, hand
# SIGTERM/SIGINT on to it, and wait for its own exit status.
# Every signal is forwarded, though the command often got its own copy too (SLURM signals every
# process of a step, a terminal every process of its foreground group): bash cannot tell who
# else was signalled, and a signal sent to this shell alone must still reach the command. The
# commands take repeats as one request: k3train (repeats within 5 s) and torchrun's agent via
# torchrun_stop_once.py (everything after its first stop signal).
#   forward_signals_run CMD...   -> sets FORWARDED_RC (the command's status) and
#                                   FORWARDED_SIGNAL (1 if a signal was forwarded)
forward_signals_run() {
  FORWARDED_SIGNAL=0
  "$@" &
  local child=$!
  trap 'FORWARDED_SIGNAL=1; kill -TERM '"$child"' 2>/dev/null' TERM
  trap 'FORWARDED_SIGNAL=1; kill -INT '"$child"' 2>/dev/null' INT
  wait "$child"
  local rc=$? again
  # A trapped signal interrupts wait (status > 128): wait again while the child lives, and once
  # more after, for its own status (127: the shell had already reaped it).
  while [[ $rc -gt 128 ]] && kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done
  if [[ $rc -gt 128 ]]; then wait "$child" 2>/dev/null; again=$?; [[ $again -ne 127 ]] && rc=$again; fi
  FORWARDED_RC=$rc
}
