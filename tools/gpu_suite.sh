#!/usr/bin/env bash
# GPU checks and benchmarks, in priority order:
#   bash tools/gpu_suite.sh OUTDIR [STAGES]     (STAGES: comma list, default all)
# Stages: gpu_check train_cuda bench_kda bench_step bench_moe_layer bench_fp8 (one GPU; bench_step
# also as bench_step_mini + bench_step_peer, and bench_quantile, bench_muon, bench_grouped_experts,
# bench_moe_layer_k3, first_step_tune + first_step_picks, first_step_shipped, bench_slice, fp8_slice, engine_kernels, engine_graph, predict_busy, study_optim, study_attnres, study_bal,
# study_bal_sparse, study_mqar, study_mqar_pairs (STUDIES_FROM=TGZ seeds the studies' run directories),
# te_receive, te_install, te_bench (tools/te_device.sh), and the pending checks save_stall
# decode_compile fp8_experts bf16_weights capacity_modes capacity_1m capacity_split
# memory_plan_slice te_check docmask_check docmask_train capacity_mask_graphed kda_cp chunk_docs timeline_offload
# mixer_pieces capacity_pieces: explicit only);
# gpu_parallel (GPU_PARALLEL_ONLY=a,b picks variants) bench_moe_ep2 bench_pipeline pp_debug (two
# GPUs, skipped on one).
# Together the stages need more than one 10-minute device call: pass a subset per call.
# Logs and JSON land in OUTDIR. Each stage has its own time limit so one slow stage cannot eat
# the others. fla's compiled Triton kernels and autotune results go to TRITON_CACHE_DIR (default
# /tmp/k3_triton_cache), which a later machine can reuse: tar it up after a run, unpack it before.
set -u
OUT=${1:?usage: gpu_suite.sh OUTDIR [STAGES]}
STAGES=",${2:-gpu_check,train_cuda,bench_kda,bench_step,bench_moe_layer,bench_fp8,gpu_parallel,bench_moe_ep2,bench_pipeline},"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k3_triton_cache}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ echo "gpus: $NGPU"; nvidia-smi --query-gpu=name,memory.total --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > "$OUT/env.txt" 2>&1

# SUITE_SECONDS: a budget for the whole suite (e.g. a device call's limit minus packing time);
# each stage's limit shrinks to what is left. PACK_TO: re-pack OUTDIR there after every stage,
# so what finished comes back even if the call is cut off.
stage() {
  local name=$1 limit=$2; shift 2
  [[ $STAGES == *",$name,"* ]] || return 0
  if [ "${SUITE_SECONDS:-0}" -gt 0 ]; then
    local left=$((SUITE_SECONDS - SECONDS))
    if [ "$left" -lt 20 ]; then echo "== $name skipped: suite budget spent"; return 0; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc seconds=$((SECONDS - t0))" >> "$OUT/$name.log"
  # timeout kills the stage's own process only: a child it started (a training subprocess) can
  # live on holding GPU memory, which made the next stage run out of memory (2026-12-04).
  if [ "$rc" -eq 124 ]; then
    for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
      kill -9 "$pid" 2>/dev/null && echo "killed leftover GPU process $pid" >> "$OUT/$name.log"
    done
  fi
  tail -4 "$OUT/$name.log"
  if [ -n "${PACK_TO:-}" ]; then tar czf "$PACK_TO" --exclude=checkpoints -C "$(dirname "$OUT")" "$(basename "$OUT")"; fi
}

# Correctness stages keep one autotune candidate per fla kernel (K3TRAIN_AUTOTUNE=fixed: kernel
# speed is not what they measure); benchmarks autotune fully. Every stage compiles its kernels
# ahead, in parallel (k3train/ops/triton_compile.py). gpu_parallel checks NCCL parallelism with
# the pure-torch kernels: what it tests is communication, and each of its ten processes would
# otherwise compile.
FIXED=(env K3TRAIN_AUTOTUNE=fixed)
stage gpu_check 300 "${FIXED[@]}" python3 scripts/gpu_check.py --json "$OUT/gpu_check.json"
stage train_cuda 150 "${FIXED[@]}" python3 -m k3train train --config configs/k3_tiny.yaml --run-dir /tmp/run_tiny \
  train.device=cuda train.cuda_graph=true train.steps=150 train.micro_batch_size=32 train.seq_len=256 \
  logging.progress_bar=false
cp /tmp/run_tiny/metrics.jsonl "$OUT/train_cuda_metrics.jsonl" 2>/dev/null
stage bench_kda 240 python3 -m benchmarks.bench_kda_layer --profile --json "$OUT/bench_kda.json"
stage bench_step 420 python3 -m benchmarks.bench_step --steps 5 --warmup 2 --profile --json "$OUT/bench_step.json"
# The same rows split in two, to run at once on two GPUs: k3_mini with its profile; ours dense
# against fla's model (the ratio they report needs both sides in one run).
stage bench_step_mini 420 python3 -m benchmarks.bench_step --rows k3_mini,k3_mini_eager,k3_mini_accum --steps 5 --warmup 3 \
  --profile --profile-shapes --json "$OUT/bench_step_mini.json"
stage bench_quantile 180 python3 -m benchmarks.bench_quantile --json "$OUT/bench_quantile.json"
# K3's MoE sizes on one GPU (benchmarks/README.md), with bench_quantile.
stage bench_grouped_experts 200 python3 -m benchmarks.bench_grouped_experts --json "$OUT/bench_grouped_experts.json"
stage bench_moe_layer_k3 200 python3 -m benchmarks.bench_moe_layer --shape k3 --json "$OUT/bench_moe_layer_k3.json"
stage bench_muon 180 python3 -m benchmarks.bench_muon --json "$OUT/bench_muon.json"
stage bench_moe_layer 120 python3 -m benchmarks.bench_moe_layer --profile --json "$OUT/bench_moe_layer.json"
stage bench_step_peer 420 python3 -m benchmarks.bench_step --rows dense,peer --steps 5 --warmup 3 \
  --json "$OUT/bench_step_peer.json"
stage bench_fp8 240 python3 -m benchmarks.bench_fp8 --steps 30 --out /tmp/bench_fp8
cp /tmp/bench_fp8/bench_fp8.json "$OUT/" 2>/dev/null
# The first step with recorded autotune picks: tune everything on fresh caches and keep
# the picks, then fresh caches again reading them (what a shipped k3train/ops/autotune_data file gives).
stage first_step_tune 170 python3 -m benchmarks.bench_first_step --timeout 160 --save-picks "$OUT/autotune_picks.json" \
  --json "$OUT/first_step_tune.json" kernels.autotune_picks=none
[ -f "$OUT/autotune_picks.json" ] && stage first_step_picks 150 python3 -m benchmarks.bench_first_step --timeout 140 \
  --json "$OUT/first_step_picks.json" "kernels.autotune_picks=$OUT/autotune_picks.json"
# What a user gets on a fresh H200: the picks the project ships (kernels.autotune_picks=auto).
stage first_step_shipped 150 python3 -m benchmarks.bench_first_step --timeout 140 --json "$OUT/first_step_shipped.json"
# The K3 slice's training step (the MFU rows; one autocast region per step since 2026-12-02).
stage bench_slice 200 python3 -m benchmarks.bench_slice --microbatches 4 --json "$OUT/slice.json"
# fp8 against bf16 at the slice's widths (the preset's AdamW 3e-5 with its warm-up applied).
stage fp8_slice 260 python3 -m benchmarks.bench_fp8 --preset slice --recipes bf16 fp8 --steps 10 --warmup 3 \
  --profile 15 --out "$OUT/fp8_slice"
# The engine overhead at P=1 with one profiled step per runner: GPU kernel time (free of
# host jitter), launches and host time beside the step-time ratios.
stage engine_kernels 420 python3 -m benchmarks.bench_engine_overhead --shape pipeline --vpp 1,2,4 --steps 4 \
  --kernels --json "$OUT/engine_kernels.json"
# The same with every runner replayed from its own CUDA graph: the engine at P=1 without launch
# time. One autotune candidate per kernel: with full autotuning the AttnRes kernels' tuning took
# the whole 360 s (2026-12-02); V=4 adds about a third to the 240 s this takes.
stage engine_graph 320 "${FIXED[@]}" python3 -m benchmarks.bench_engine_overhead --shape pipeline --vpp 1,2 --steps 6 \
  --graph --kernels --json "$OUT/engine_graph.json"
# The timing model from 4-layer chunks, with each variant's GPU-busy share of its chunk spans.
stage predict_busy 200 python3 -m benchmarks.timing_model gpu --layers-per-chunk 4 --json "$OUT/predict.json"
# The seeded studies (docs/ablations.md): unpack benchmarks/results/h200-2026-12-02c/study_runs.tgz into
# OUTDIR/studies first (STUDIES_FROM), so each sweep trains only what is missing; the run directories
# come back in OUTDIR (packed without checkpoints). At most 12 runs at once.
if [ -n "${STUDIES_FROM:-}" ] && [ ! -d "$OUT/studies" ]; then mkdir -p "$OUT/studies" && tar xzf "$STUDIES_FROM" -C "$OUT/studies"; fi
stage study_optim 540 python3 -m k3train sweep configs/ablations/gpu/optimizer.yaml --jobs 12 --out "$OUT"/studies/study_optim
stage study_attnres 400 python3 -m k3train sweep configs/ablations/gpu/attnres.yaml --jobs 6 --out "$OUT"/studies/study_attnres
stage study_bal 400 python3 -m k3train sweep configs/ablations/gpu/balancing.yaml --jobs 10 --out "$OUT"/studies/study_bal
stage study_bal_sparse 540 python3 -m k3train sweep configs/ablations/gpu/balancing_sparse.yaml --jobs 10 \
  --out "$OUT"/studies/study_bal_sparse
stage study_mqar 540 python3 -m k3train sweep configs/ablations/gpu/mqar.yaml --jobs 12 --out "$OUT"/studies/study_mqar
stage study_mqar_pairs 540 python3 -m k3train sweep configs/ablations/gpu/mqar_pairs.yaml --jobs 12 \
  --out "$OUT"/studies/study_mqar_pairs
# Transformer Engine, over consecutive calls on one warm machine: te_receive once per
# carried part (.te/parts/te.tar.part-aa ... -af, from `bash tools/te_device.sh fetch`), then
# te_install (installs, builds the torch binding there), then te_bench, which times: nothing else
# may share the GPU (tools/gpu_background.sh pause NAME around it).
# Checks of paths built on CPU and not yet run on a GPU (2026-12-04), explicit only, most needed
# first: the async-save stall (issue 44; the slice's ~40 GiB checkpoint), the compiled decode
# step's logits against eager, the FP8 routed experts' kernel against its emulation, bf16
# weights on the slice, the capacity table and 1M tokens (bench_capacity's five calls), TE
# (te_receive/te_install first), the planner against the slice's measured peak.
# Built on CPU on 2026-12-04 (third session), most needed first: graphed document masking
# (ops replayed on new boundaries; the trainer's graphed masked step against eager, then its
# masking cost at 4K), the KDA context-parallel fold with fla's kernels.
stage docmask_check 200 python3 scripts/gpu_check_document_mask.py --seq 1024 --json "$OUT/docmask.json"
stage docmask_train 420 python3 scripts/gpu_check_graphed_documents.py --steps 30 --json "$OUT/docmask_train.json"
stage capacity_mask_graphed 400 python3 -m benchmarks.bench_capacity --parts mask --mask-seqs 4096 \
  --mask-rows unmasked_graphed,masked_graphed,masked_eager --budget-s 380 --json "$OUT/capacity_mask_graphed.json"
stage kda_cp 200 python3 scripts/gpu_check_kda_cp.py --json "$OUT/kda_cp.json"
stage chunk_docs 300 "${FIXED[@]}" python3 -m benchmarks.bench_chunk_graphs --mask --seq 4096 --check-steps 20 \
  --json "$OUT/chunk_docs.json"
# What the planner's calibrated FUSED_HALF_BACKWARD factor stands for (docs/memory.md): the
# live allocations at the peak of a full + offload step, by operator (the 1M-token question).
stage timeline_offload 420 python3 -m benchmarks.bench_memory_plan --modes full --timeline \
  --json "$OUT/timeline_offload.json" train.seq_len=65536 train.micro_batch_size=1 train.offload_activations=true
stage save_stall 540 python3 -m benchmarks.bench_save_stall --out /tmp/save_stall --microbatches 4 ${SAVE_MODES:+--modes $SAVE_MODES} \
  --max-steps-during-write 30 --override kernels.autotune=fixed --json "$OUT/save_stall.json"
stage decode_compile 240 python3 -m benchmarks.bench_decode --config configs/k3_mini.yaml --batch 1,16 --tokens 128 \
  --compile --json "$OUT/decode_compile.json"
stage fp8_experts 300 python3 scripts/gpu_check_fp8_experts.py --json "$OUT/fp8_experts.json"
stage bf16_weights 540 python3 scripts/gpu_check_bf16_weights.py --steps 20 --json "$OUT/bf16_weights.json"
stage capacity_modes 560 python3 -m benchmarks.bench_capacity --modes none,selective,full --parts modes \
  --budget-s 540 --json "$OUT/capacity_modes.json"
# train.recompute_pieces now cuts the mixer halves too (k3train/model/mixer_pieces.py): the
# KDA and MLA layers in pieces on the GPU kernels against fp64, then 256K to 1M tokens with 8 pieces.
stage mixer_pieces 240 python3 scripts/gpu_check_mixer_pieces.py --seq-len 8192 --pieces 4 --json "$OUT/mixer_pieces.json"
stage capacity_pieces 560 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m benchmarks.bench_capacity \
  --config configs/k3_mini.yaml --modes full+offload --min-seq 262144 --max-seq 1048576 --parts modes --steps 1 \
  --warmup 1 --override train.recompute_pieces=8 --override kernels.autotune=fixed --budget-s 540 \
  --json "$OUT/capacity_pieces.json"
stage capacity_1m 560 python3 -m benchmarks.bench_capacity --modes full+offload --min-seq 262144 \
  --parts check,modes --budget-s 540 --json "$OUT/capacity_1m.json"
stage capacity_split 560 python3 -m benchmarks.bench_capacity --parts split,mask --max-seq 524288 --budget-s 540 \
  --json "$OUT/capacity_split.json"
stage memory_plan_slice 360 python3 -m benchmarks.bench_memory_plan --config configs/k3_slice.yaml --modes none,full \
  --steps 3 train.microbatches=4 --json "$OUT/slice_memory.json"
stage te_check 540 env PYTHONPATH="/tmp/site_te:$PYTHONPATH" python3 scripts/gpu_check_te.py --steps 60 --json "$OUT/gpu_check_te.json"
stage te_receive 60 bash tools/te_device.sh receive
stage te_install 540 bash tools/te_device.sh install
stage te_bench 300 bash tools/te_device.sh bench
if [ "$NGPU" -ge 2 ]; then
  stage gpu_parallel 420 env K3TRAIN_KERNELS=torch K3TRAIN_COMPILE=0 python3 scripts/gpu_parallel_check.py \
    --out /tmp/gpu_parallel --run-limit 90 ${GPU_PARALLEL_ONLY:+--only $GPU_PARALLEL_ONLY}
  cp /tmp/gpu_parallel/*.log "$OUT/" 2>/dev/null
  # Where a hung pipeline run waits: every rank's Python stacks after 35 s (K3TRAIN_STACKS_AFTER).
  stage pp_debug 130 env K3TRAIN_KERNELS=torch K3TRAIN_COMPILE=0 K3TRAIN_STACKS_AFTER=35 NCCL_DEBUG=WARN bash -c '
    for v in 2 1; do
      timeout 60 torchrun --standalone --nproc-per-node 2 -m k3train train --config configs/k3_tiny.yaml \
        --run-dir /tmp/ppdbg$v parallel.pp=2 parallel.vpp=$v train.micro_batch_size=8 train.microbatches=2 \
        train.steps=3 train.log_interval=1 logging.wandb.mode=disabled logging.progress_bar=false \
        checkpoint.interval=0 train.device=cuda
      echo "pp=2 vpp=$v rc=$?"
    done'
  stage bench_moe_ep2 60 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_moe_dispatch
  stage bench_pipeline 240 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_pipeline \
    --vpp 1,2,4 --steps 5 --json "$OUT/bench_pipeline.json"
fi
true
