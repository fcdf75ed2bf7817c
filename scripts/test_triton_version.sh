#!/usr/bin/env bash
# Run our Triton kernels' interpreter tests with another Triton release, without touching the
# active environment: the release is installed into a temporary directory put first on PYTHONPATH.
#   bash scripts/test_triton_version.sh 3.6.0
set -euo pipefail
version=${1:?usage: scripts/test_triton_version.sh TRITON_VERSION (e.g. 3.6.0)}
cd "$(dirname "$0")/.."
target="$(mktemp -d -t k3train-triton.XXXXXX)"
trap 'rm -rf "$target"' EXIT
python -m pip install -q --no-deps --target "$target" "triton==$version"
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
python -c "import triton, sys; print('triton', triton.__version__, 'from', triton.__file__); sys.exit(triton.__version__ != '$version')"
python -m pytest -q tests/ops/test_short_conv_triton.py tests/moe/test_topk_triton.py \
  tests/optim/test_momentum_triton.py tests/optim/test_ns_gemm_triton.py
