# Next session, call B (~9.5 min): #20 prediction with full autotuning, slice memory per recompute mode; #22 slice MFU.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
R=/tmp/rB; mkdir -p $R; BUDGET=${BUDGET:-565}
st() { local name=$1 limit=$2; shift 2; local left=$((BUDGET - SECONDS)); [ $left -lt 15 ] && { echo "== $name skipped"; return; }
  [ $left -lt $limit ] && limit=$left; local t0=$SECONDS; echo "== $name (limit $limit)"
  timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$? seconds=$((SECONDS-t0))" | tee -a $R/$name.log; grep -v -i "warn\|recompiles\]" $R/$name.log | tail -${TAILN:-12} | cut -c1-300
  tar czf $OUT/rB.tgz -C /tmp rB; }
TAILN=12 st slice 200 python3 scripts/bench/bench_slice.py --microbatches 4 --json $R/slice.json
TAILN=8 st mem_slice 180 python3 scripts/bench/bench_memory_plan.py --config configs/k3_slice.yaml --json $R/mem_slice.json train.microbatches=2
TAILN=40 st predict 180 python3 scripts/bench/predict_pipeline.py --json $R/predict.json
echo total $SECONDS
