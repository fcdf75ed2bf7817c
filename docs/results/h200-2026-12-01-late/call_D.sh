# Next session, call D (~9.5 min, if time allows): engine overhead with the A/A control (issue 20), AttnRes vs standard memory on one GPU (issue 20), Muon share at the slice (issue 22; needs call B's slice.json copied to .gpu/slice.json).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
R=/tmp/rD; mkdir -p $R; BUDGET=${BUDGET:-565}
st() { local name=$1 limit=$2; shift 2; local left=$((BUDGET - SECONDS)); [ $left -lt 15 ] && { echo "== $name skipped"; return; }
  [ $left -lt $limit ] && limit=$left; local t0=$SECONDS; echo "== $name (limit $limit)"
  timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$? seconds=$((SECONDS-t0))" | tee -a $R/$name.log; grep -v -i "warn\|recompiles\]" $R/$name.log | tail -${TAILN:-12} | cut -c1-300
  tar czf $OUT/rD.tgz -C /tmp rD; }
TAILN=14 st engine 330 python3 scripts/bench/bench_engine_overhead.py --shape pipeline --steps 12 --variants standard --json $R/engine_std.json
TAILN=8 st mem_mini_std 130 python3 scripts/bench/bench_memory_plan.py --modes full,selective --json $R/mem_mini_std.json model.attnres.enabled=false
[ -f .gpu/slice.json ] && TAILN=20 st muon_slice 80 python3 scripts/bench/bench_muon.py --slice --slice-json .gpu/slice.json --json $R/muon_slice.json
echo total $SECONDS
