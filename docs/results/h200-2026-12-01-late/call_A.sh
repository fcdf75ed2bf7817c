# Next session, call A (~9.5 min): verify this session's CPU-side changes on the GPU.
# #22: first step with the optimizer in compile-ahead (warm_kernels); #20: memory planner after the fla
# count fix (k3_mini); #22: fp8 at the slice with the AdamW rate fixed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
R=/tmp/rA; mkdir -p $R; BUDGET=${BUDGET:-565}
st() { local name=$1 limit=$2; shift 2; local left=$((BUDGET - SECONDS)); [ $left -lt 15 ] && { echo "== $name skipped"; return; }
  [ $left -lt $limit ] && limit=$left; local t0=$SECONDS; echo "== $name (limit $limit)"
  timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$? seconds=$((SECONDS-t0))" | tee -a $R/$name.log; grep -v -i "warn\|recompiles\]" $R/$name.log | tail -${TAILN:-12} | cut -c1-300
  tar czf $OUT/rA.tgz -C /tmp rA; }
TAILN=10 st first_step 150 python3 scripts/bench/bench_first_step.py --timeout 145 --stacks 10 --json $R/first_step.json
TAILN=8 st mem_mini 170 python3 scripts/bench/bench_memory_plan.py --json $R/mem_mini.json
TAILN=60 st fp8_slice 250 python3 scripts/bench/bench_fp8.py --preset slice --recipes bf16 fp8 --steps 10 --warmup 3 --profile 25 --out $R/fp8_slice
echo total $SECONDS
