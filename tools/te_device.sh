#!/usr/bin/env bash
# Transformer Engine on a lent GPU machine, whose one transfer carries at most 64 MiB: the
# 276.5 MB core wheel travels in parts over consecutive calls while the machine stays warm.
#
#   here:   bash tools/te_device.sh fetch        # downloads into .te/ and splits .te/parts/te.tar.part-*
#   device: bash tools/te_device.sh receive      # one call per part, carry [".te/parts/te.tar.part-aa"], ...
#                                                  # (5 parts of 59 MB: each travels alone, beside the 7 MB
#                                                  #  working tree, under the 64 MiB a call carries)
#   device: bash tools/te_device.sh install      # after the last part: install, build the torch binding
#   device: bash tools/te_device.sh bench        # benchmarks/bench_te_linear.py at the slice's shapes
#
# The parts wait in /tmp/te_parts, which a warm machine keeps between calls (a machine returned
# in between loses them: start again from part aa). install puts Transformer Engine under
# /tmp/site_te, apart from /tmp/site (where tools/gpu_session.sh puts the other wheels):
# megatron-core imports transformer_engine whenever it is found, and a TE that is found but not
# yet whole raises AssertionError, not ImportError, which broke every training run beside it
# (2026-12-02). Only bench puts /tmp/site_te on PYTHONPATH. Logs go to $OUT. .te/ is git-ignored
# (.gitignore): the parts travel only as carried paths.
set -u
TE_VERSION=2.20.2
case "${1:-}" in
fetch)
  mkdir -p .te/dl .te/parts && rm -f .te/parts/*
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64)
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .te/dl "transformer-engine-cu13==$TE_VERSION" "transformer-engine==$TE_VERSION" einops nvdlfw-inspect "nvidia-cudnn-frontend>=1.29" \
    wheel packaging "setuptools<81" || exit 1
  # The binding is a source archive only; pip download would try to build its metadata, so
  # fetch the archive itself from the index.
  url=$(curl -s https://pypi.org/simple/transformer-engine-torch/ | grep -o "https://[^\"#]*transformer_engine_torch-$TE_VERSION.tar.gz" | head -1)
  curl -s -o ".te/dl/transformer_engine_torch-$TE_VERSION.tar.gz" "$url" || exit 1
  # Wheels are compressed already: a plain tar, in 59 MB parts (each call carries one).
  tar cf - -C .te/dl . | split -b 59000000 - .te/parts/te.tar.part-
  ls -la .te/parts ;;
receive)
  : "${OUT:?OUT must be set}"
  mkdir -p /tmp/te_parts && cp .te/parts/te.tar.part-* /tmp/te_parts/ && ls -la /tmp/te_parts | tee "$OUT/te_parts.txt" ;;
install)
  : "${OUT:?OUT must be set}"
  rm -rf /tmp/te_dl /tmp/site_te /tmp/te_meta /tmp/te_torch && mkdir -p /tmp/te_dl /tmp/site_te
  cat /tmp/te_parts/te.tar.part-* | tar xf - -C /tmp/te_dl || { echo "parts incomplete: $(ls /tmp/te_parts)"; exit 1; }
  # The core wheel holds the libraries and the Python package; the transformer-engine wheel
  # only adds the distribution that TE's import-time check looks for (installing it over the
  # core's package directory would replace that directory), so only its metadata is kept.
  pip_t() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$@"; }
  pip_t /tmp/site_te $(ls /tmp/te_dl/*.whl | grep -v "/transformer_engine-$TE_VERSION-") > "$OUT/te_install.log" 2>&1 \
    && pip_t /tmp/te_meta "/tmp/te_dl/transformer_engine-$TE_VERSION-py3-none-any.whl" >> "$OUT/te_install.log" 2>&1 \
    && cp -r "/tmp/te_meta/transformer_engine-$TE_VERSION.dist-info" /tmp/site_te/ \
    || { tail -20 "$OUT/te_install.log"; exit 1; }
  export PYTHONPATH=/tmp/site_te:/tmp/site CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  # No network here: never try the prebuilt-wheel download, build against this machine's torch
  # (33 C++ files, about 130 s on 16 cores). The built wheel puts its library inside
  # transformer_engine/, which pip --target will not merge into an existing directory: build
  # into its own target and copy it over.
  export NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=$(nproc) NVTE_FRAMEWORK=pytorch
  t0=$SECONDS
  python3 -m pip install -v --no-index --no-deps --no-build-isolation --target /tmp/te_torch \
    "/tmp/te_dl/transformer_engine_torch-$TE_VERSION.tar.gz" > "$OUT/te_build.log" 2>&1
  echo "build rc=$? seconds=$((SECONDS - t0))" | tee -a "$OUT/te_build.log"
  cp -r /tmp/te_torch/. /tmp/site_te/
  python3 -c "import transformer_engine.pytorch as te; print('transformer_engine $TE_VERSION imports')" \
    2>&1 | tail -5 | tee "$OUT/te_import.log" ;;
bench)
  : "${OUT:?OUT must be set}"
  PYTHONPATH=/tmp/site_te:/tmp/site:$PWD python3 -m benchmarks.bench_te_linear --json "$OUT/te_linear.json" 2>&1 | tee "$OUT/te_linear.log" ;;
*)
  echo "usage: bash tools/te_device.sh fetch|receive|install|bench" >&2; exit 2 ;;
esac
