#!/usr/bin/env bash
# One call on a lent GPU machine (the k3train developers' device tool): install the carried
# wheels, reuse a carried Triton cache, run gpu_suite.sh stage lists, pack what comes back.
#   bash tools/gpu_session.sh STAGES [STAGES2]     (needs $OUT; wheels in .whl/, cache .whl/tcache.tgz)
# Two lists run at the same time, the first on GPU 0 and the second on GPU 1 (one-GPU stages
# only); one list sees every GPU. Comes back in $OUT: res_0.tgz (res_1.tgz) with every stage's
# log and JSON, and the Triton cache: tcache.tgz.part-* (whole, when it packs under 45 MB) or
# tcache.tgz (autotune results only). Copy those into .whl/ for the next machine.
set -u
: "${OUT:?OUT must be set}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/k3_triton_cache
# A carried cache is either whole (tcache.tgz.part-aa, -ab, ... in order) or autotune results only.
if [ ! -d "$TRITON_CACHE_DIR" ]; then
  if ls .whl/tcache.tgz.part-* > /dev/null 2>&1; then cat .whl/tcache.tgz.part-* | tar xzf - -C /tmp
  elif [ -f .whl/tcache.tgz ]; then tar xzf .whl/tcache.tgz -C /tmp; fi
fi
# 540 s of stages leave a 600 s call time to pack; results are re-packed after every stage.
export SUITE_SECONDS=${SUITE_SECONDS:-540}
if [ $# -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 PACK_TO="$OUT/res_0.tgz" bash tools/gpu_suite.sh /tmp/res0 "$1" &
  CUDA_VISIBLE_DEVICES=1 PACK_TO="$OUT/res_1.tgz" bash tools/gpu_suite.sh /tmp/res1 "$2" &
  wait
else
  PACK_TO="$OUT/res_0.tgz" bash tools/gpu_suite.sh /tmp/res0 "$1"
fi
# TCACHE_HOME=0 leaves the cache on the machine: when a warm machine's next call must follow
# within its 30 s, 32 MB coming back can cost it (2026-12-02, the machine went back).
[ "${TCACHE_HOME:-1}" = 0 ] && { ls -la "$OUT"; exit 0; }
# gzip -1, not xz: xz spent the last seconds of a call on an 87 MB cache and left it truncated.
# Whole cache in 15 MB parts (files come back up to 16 MiB each) when it packs under 45 MB,
# which still travels back in .whl/ (64 MiB carry limit); else only the autotune results, with
# which the next machine compiles just the chosen candidates.
tar cf - -C /tmp k3_triton_cache | gzip -1 > /tmp/tcache.tgz
if [ "$(stat -c %s /tmp/tcache.tgz)" -le 45000000 ]; then
  split -b 15000000 /tmp/tcache.tgz "$OUT/tcache.tgz.part-"
else
  (cd /tmp && find k3_triton_cache -name '*.autotune.json' | tar czf "$OUT/tcache.tgz" -T -)
fi
ls -la "$OUT"
