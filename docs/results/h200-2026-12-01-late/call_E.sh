# call E: #22 first step rerun (call A's child segfaulted at 90 s in the compile pass); #20 slice memory under full.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
R=/tmp/rE; mkdir -p $R; BUDGET=${BUDGET:-400}
st() { local name=$1 limit=$2; shift 2; local left=$((BUDGET - SECONDS)); [ $left -lt 15 ] && { echo "== $name skipped"; return; }
  [ $left -lt $limit ] && limit=$left; local t0=$SECONDS; echo "== $name (limit $limit)"
  timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$? seconds=$((SECONDS-t0))" | tee -a $R/$name.log; grep -v -i "warn\|recompiles\]" $R/$name.log | grep -v "^ *[0-9.]*s |  " | tail -${TAILN:-12} | cut -c1-300
  tar czf $OUT/rE.tgz -C /tmp rE; }
TAILN=14 st first_step 155 python3 scripts/bench/bench_first_step.py --timeout 150 --stacks 30 --json $R/first_step.json
TAILN=8 st mem_slice_full 230 python3 scripts/bench/bench_memory_plan.py --config configs/k3_slice.yaml --modes full --json $R/mem_slice_full.json train.microbatches=2
echo total $SECONDS
