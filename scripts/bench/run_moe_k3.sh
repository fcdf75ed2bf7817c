#!/usr/bin/env bash
# The MoE benchmarks at K3's real sizes on one GPU, each writing OUT_DIR/<name>.json and .log:
#   bench_quantile          router top-k and Quantile Balancing at 64/4, 256/8, 384/8, 896/16,
#                           16K and 64K tokens, each shape checked on the device first (~1 min)
#   bench_grouped_experts   torch._grouped_mm on one EP rank's share of K3's experts vs a dense
#                           GEMM of the same FLOPs (~1.5 min)
#   bench_moe_layer_k3      K3's MoE layer by part, one EP=8 rank's share, 16K-64K tokens (~2 min)
# Usage: scripts/bench/run_moe_k3.sh OUT_DIR     (exit status 1 if any of them failed)
set -uo pipefail
out=${1:?usage: scripts/bench/run_moe_k3.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled
status=0
run() {  # run NAME SCRIPT ARGS...: one benchmark, at most 4 minutes
    local name=$1 script=$2
    shift 2
    echo "== $name" >&2
    timeout 240 python3 "scripts/bench/$script" "$@" --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name failed with status $rc" >&2; status=1; }
}
run bench_quantile bench_quantile.py
run bench_grouped_experts bench_grouped_experts.py
run bench_moe_layer_k3 bench_moe_layer.py --shape k3
exit $status
