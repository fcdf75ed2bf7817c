# The four device calls of 2026-12-02 (second session), one warm H200, all at main 40d2a56,
# chained while the machine stayed warm (each carried .whl/ with the wheels listed in docs/DEPENDENCIES.md).
# Call 1 (464 s):
bash scripts/gpu_session.sh first_step_tune,first_step_picks,fp8_slice
# Call 2 (407 s): the first call's /tmp/res0 and Triton cache were still there, so res_0.tgz holds both.
STUDIES_FROM=docs/results/h200-2026-12-02/study_runs.tgz bash scripts/gpu_session.sh bench_slice,predict_busy,study_bal
# Call 3 (271 s): the optimizer and AttnRes sweeps side by side (8 + 2 runs at once).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/k3_triton_cache SUITE_SECONDS=530 STUDIES_FROM=docs/results/h200-2026-12-02/study_runs.tgz
PACK_TO=$OUT/res_0.tgz bash scripts/gpu_suite.sh /tmp/r3a study_optim & PACK_TO=$OUT/res_1.tgz bash scripts/gpu_suite.sh /tmp/r3b study_attnres & wait
# Call 4 (480 s): k3_mini with 4 microbatches alone, then MQAR (7 at once) beside the 256-expert balancing sweep (5 at once), both cut at 480 s.
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/k3_triton_cache WANDB_MODE=disabled PYTHONUNBUFFERED=1; R=/tmp/r4
mkdir -p $R/studies; tar xzf docs/results/h200-2026-12-02/study_runs.tgz -C $R/studies
timeout 150 python3 scripts/bench/bench_step.py --rows k3_mini_accum --steps 5 --warmup 3 --profile --json $R/bench_mini_accum.json > $R/bench_mini_accum.log 2>&1
L=$((480-SECONDS))
timeout $L python3 -m k3train sweep configs/ablations/gpu/mqar.yaml --jobs 7 --out $R/studies/study_mqar > $R/study_mqar.log 2>&1 &
timeout $L python3 -m k3train sweep configs/ablations/gpu/balancing_sparse.yaml --jobs 5 --out $R/studies/study_bal_sparse > $R/study_bal_sparse.log 2>&1 &
wait
