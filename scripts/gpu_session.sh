#!/usr/bin/env bash
# One call on a lent GPU machine (the k3train developers' device tool): install the carried
# wheels, reuse a carried Triton cache, run gpu_suite.sh stages, pack what comes back.
#   bash scripts/gpu_session.sh STAGES        (needs $OUT; wheels in .whl/, cache in .whl/tcache.tar.xz)
# Comes back in $OUT: res.tgz (every stage's log and JSON) and tcache.tgz (the Triton cache:
# whole when it packs under 15 MiB, else only the autotune results, which skip the benchmarking).
set -u
: "${OUT:?OUT must be set}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/k3_triton_cache
[ -f .whl/tcache.tgz ] && [ ! -d "$TRITON_CACHE_DIR" ] && tar xzf .whl/tcache.tgz -C /tmp
# 540 s of stages leave a 600 s call time to pack; res.tgz is re-packed after every stage.
SUITE_SECONDS=${SUITE_SECONDS:-540} PACK_TO="$OUT/res.tgz" bash scripts/gpu_suite.sh /tmp/res "$1"
# gzip -1, not xz: xz spent the last seconds of a call on an 87 MB cache and left it truncated.
tar cf - -C /tmp k3_triton_cache | gzip -1 > "$OUT/tcache.tgz"
if [ "$(stat -c %s "$OUT/tcache.tgz")" -gt 15000000 ]; then
  (cd /tmp && find k3_triton_cache -name '*.autotune.json' | tar czf "$OUT/tcache.tgz" -T -)
fi
ls -la "$OUT"
