#!/usr/bin/env bash
# One call on a lent GPU machine (the k3train developers' device tool): install the carried
# wheels, reuse a carried Triton cache, run gpu_suite.sh stages, pack what comes back.
#   bash scripts/gpu_session.sh STAGES        (needs $OUT; wheels in .whl/, cache in .whl/tcache.tar.xz)
# Comes back in $OUT: res.tgz (every stage's log and JSON) and tcache.tar.xz (the Triton cache:
# whole when it packs under 15 MiB, else only the autotune results, which skip the benchmarking).
set -u
: "${OUT:?OUT must be set}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/k3_triton_cache
[ -f .whl/tcache.tar.xz ] && [ ! -d "$TRITON_CACHE_DIR" ] && tar xJf .whl/tcache.tar.xz -C /tmp
bash scripts/gpu_suite.sh /tmp/res "$1"
tar czf "$OUT/res.tgz" --exclude=checkpoints -C /tmp res
tar cJf "$OUT/tcache.tar.xz" -C /tmp k3_triton_cache
if [ "$(stat -c %s "$OUT/tcache.tar.xz")" -gt 15000000 ]; then
  (cd /tmp && find k3_triton_cache -name '*.autotune.json' -o -name '*autotune*' | tar cJf "$OUT/tcache.tar.xz" -T -)
fi
ls -la "$OUT"
