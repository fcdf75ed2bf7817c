#!/usr/bin/env bash
# One call on a lent GPU machine (the k3train developers' device tool): install the carried
# wheels, reuse a carried Triton cache, run gpu_suite.sh stage lists, pack what comes back.
#   bash scripts/gpu_session.sh STAGES [STAGES2]     (needs $OUT; wheels in .whl/, cache .whl/tcache.tgz)
# Two lists run at the same time, the first on GPU 0 and the second on GPU 1 (one-GPU stages
# only); one list sees every GPU. Comes back in $OUT: res_0.tgz (res_1.tgz) with every stage's
# log and JSON, and tcache.tgz (the Triton cache: whole when it packs under 15 MiB, else only
# the autotune results).
set -u
: "${OUT:?OUT must be set}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/k3_triton_cache
[ -f .whl/tcache.tgz ] && [ ! -d "$TRITON_CACHE_DIR" ] && tar xzf .whl/tcache.tgz -C /tmp
# 540 s of stages leave a 600 s call time to pack; results are re-packed after every stage.
export SUITE_SECONDS=${SUITE_SECONDS:-540}
if [ $# -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 PACK_TO="$OUT/res_0.tgz" bash scripts/gpu_suite.sh /tmp/res0 "$1" &
  CUDA_VISIBLE_DEVICES=1 PACK_TO="$OUT/res_1.tgz" bash scripts/gpu_suite.sh /tmp/res1 "$2" &
  wait
else
  PACK_TO="$OUT/res_0.tgz" bash scripts/gpu_suite.sh /tmp/res0 "$1"
fi
# gzip -1, not xz: xz spent the last seconds of a call on an 87 MB cache and left it truncated.
tar cf - -C /tmp k3_triton_cache | gzip -1 > "$OUT/tcache.tgz"
if [ "$(stat -c %s "$OUT/tcache.tgz")" -gt 15000000 ]; then
  (cd /tmp && find k3_triton_cache -name '*.autotune.json' | tar czf "$OUT/tcache.tgz" -T -)
fi
ls -la "$OUT"
