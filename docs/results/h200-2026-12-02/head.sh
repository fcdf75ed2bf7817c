python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p $R; BUDGET=${BUDGET:-565}
st() { local name=$1 limit=$2; shift 2; local left=$((BUDGET - SECONDS)); [ $left -lt 15 ] && { echo "== $name skipped"; return; }
  [ $left -lt $limit ] && limit=$left; local t0=$SECONDS; echo "== $name (limit $limit)"
  timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$? seconds=$((SECONDS-t0))" | tee -a $R/$name.log; grep -v -i "warn\|recompiles\]" $R/$name.log | grep -v "^ *[0-9.]*s |  " | tail -${TAILN:-12} | cut -c1-300
  tar czf $OUT/$(basename $R).tgz -C /tmp --exclude=checkpoints $(basename $R); }
