# The device calls of 2026-12-02 (third session), one H200, code at 97879a3 plus
# scripts/gpu_background.sh (50b5931). 1,688 s of the session's 1,800 held.
# Call 1 (452 s; carried .whl/ and .te/parts/te.tar.part-af): the first step with the shipped
# picks; engine_graph with full autotuning (cut at 360 s, still autotuning the AttnRes kernels:
# engine_graph_full_autotune.log). The studies started after it were lost: the machine went
# back while the Triton cache (32 MB) travelled home, before the next call.
bash scripts/te_device.sh receive >/dev/null; SUITE_SECONDS=470 bash scripts/gpu_session.sh first_step_shipped,engine_graph
# On a fresh machine: part af with the wheels, the studies in the background, then one call per
# part (aa .. ae, carried alone: .whl/ and a 50 MB part exceed the 64 MiB a call carries).
bash scripts/te_device.sh receive; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
STUDIES_FROM=docs/results/h200-2026-12-02b/study_runs.tgz bash scripts/gpu_background.sh start st study_bal_sparse,study_mqar_pairs
bash scripts/te_device.sh receive   # x5
# te_install (134 s): the binding built in 130 s, but the import failed (te_import_first.log):
# the transformer-engine distribution was missing, and pip --target had not merged the built
# library into the existing transformer_engine/ directory. A TE that is found but fails its
# import check raises AssertionError in megatron-core's import, which failed the studies'
# runs started meanwhile. Fixed by hand, as scripts/te_device.sh install now does: the
# transformer-engine wheel's metadata, TE moved to /tmp/site_te, the cached built wheel
# installed to its own target and copied over; the studies restarted (st2).
bash scripts/te_device.sh install
STUDIES_FROM=docs/results/h200-2026-12-02b/study_runs.tgz bash scripts/gpu_background.sh start st2 study_bal_sparse,study_mqar_pairs
# te_bench, first with the studies' process group stopped, which missed the runs (the sweeps
# start each in its own session): contended, 3-6x slower (te_linear_contended.log); then with every
# study process stopped (what gpu_background.sh pause does): te_linear.log.
PYTHONPATH=/tmp/site_te:/tmp/site:$PWD python3 scripts/bench/bench_te_linear.py --json $OUT/te_linear.json
# Waiting for the studies (400 s), then the engine benchmark from CUDA graphs with one autotune
# candidate per kernel, V = 1, 2 (238 s).
bash scripts/gpu_background.sh wait st2 500
K3TRAIN_AUTOTUNE=fixed python3 scripts/bench/bench_engine_overhead.py --shape pipeline --vpp 1,2 --steps 6 --graph --kernels --json $OUT/engine_graph.json
