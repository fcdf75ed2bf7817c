#!/usr/bin/env bash
# Stages that outlive one device call. A warm machine keeps a process that started its own
# session (setsid) until the machine goes back, so long studies can train while the next calls
# carry parts, build or wait; chain the calls while it stays warm, or the work is lost.
#
#   device: bash tools/gpu_background.sh start NAME STAGES    # after gpu_session.sh installed the wheels
#   device: bash tools/gpu_background.sh wait NAME [SECONDS]  # until NAME ends or SECONDS pass (0: look now)
#   device: bash tools/gpu_background.sh pause NAME; ...; bash tools/gpu_background.sh resume NAME
#
# pause stops (SIGSTOP) every process NAME started, so that a benchmark in the foreground has
# the GPU to itself; resume continues them. The sweeps start their runs in sessions of their
# own, so the process tree is walked: stopping NAME's process group missed them, and a
# benchmark run then timed 3-6x slower on the shared GPU (2026-12-02).
#
# start copies the working tree to /tmp/bg_NAME.repo first: a later call replaces the tree it
# was started from, and the sweeps start subprocesses that import k3train afresh. Its stages
# write /tmp/bg_NAME (gpu_suite.sh OUTDIR), packed after every stage into /tmp/bg_NAME.tgz;
# wait copies that pack and the log into $OUT and says whether NAME has ended. BG_SECONDS
# (default 1100) is the stages' whole budget (SUITE_SECONDS); STUDIES_FROM passes through.
set -u
name=${2:?usage: gpu_background.sh start NAME STAGES | wait NAME [SECONDS] | pause NAME | resume NAME}
base=/tmp/bg_$name
# Every process below pid $1, by parent links.
descendants() {
  local kids; kids=$(ps -e -o pid=,ppid= | awk -v p="$1" '$2 == p {print $1}')
  for k in $kids; do echo "$k"; descendants "$k"; done
}
case "${1:-}" in
start)
  stages=${3:?usage: gpu_background.sh start NAME STAGES}
  [ -f "$base.pid" ] && kill -0 "$(cat "$base.pid")" 2>/dev/null && { echo "$name is running already"; exit 1; }
  rm -rf "$base" "$base.repo" "$base.done" "$base.tgz" && mkdir -p "$base.repo"
  tar cf - --exclude=./.te . | tar xf - -C "$base.repo"
  cd "$base.repo" || exit 1
  PYTHONPATH=${PYTHONPATH:-/tmp/site} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k3_triton_cache} \
    SUITE_SECONDS=${BG_SECONDS:-1100} PACK_TO="$base.tgz" \
    setsid nohup bash -c "bash tools/gpu_suite.sh '$base' '$stages'; echo \"ended \$(date +%T)\" > '$base.done'" \
    > "$base.log" 2>&1 < /dev/null &
  echo $! > "$base.pid"
  echo "started $name ($stages) as pid $(cat "$base.pid"); log $base.log" ;;
wait)
  : "${OUT:?OUT must be set}"
  limit=${3:-0} t0=$SECONDS
  while [ ! -f "$base.done" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 5; done
  cp "$base.log" "$OUT/bg_$name.log" 2>/dev/null
  [ -f "$base.tgz" ] && cp "$base.tgz" "$OUT/bg_$name.tgz"
  if [ -f "$base.done" ]; then echo "$name $(cat "$base.done")"; else echo "$name still running after ${limit}s"; fi
  tail -6 "$base.log" ;;
pause|resume)
  [ -f "$base.pid" ] || { echo "$name was not started"; exit 1; }
  sig=STOP; [ "$1" = resume ] && sig=CONT
  pids="$(cat "$base.pid") $(descendants "$(cat "$base.pid")")"
  kill -"$sig" $pids 2>/dev/null
  echo "$1d $name: $(echo $pids | wc -w) processes" ;;
*)
  echo "usage: bash tools/gpu_background.sh start NAME STAGES | wait NAME [SECONDS] | pause NAME | resume NAME" >&2; exit 2 ;;
esac
