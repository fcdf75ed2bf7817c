"""PP=2 step time: AttnRes + cached transport vs AttnRes + naive vs the standard residual, V in {1,2,4}.

    torchrun --nproc-per-node 2 -m benchmarks.bench_pipeline [--json OUT] [--device cpu --small|--medium]

Same model, batch and schedule for every variant; the variants of one V step in turns. Prints
the step time of each, the overhead of
AttnRes+cached over the standard residual, bytes per step and the measured bubble next to
(P-1)/(V*m).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")

# Large enough that the GPUs, not the host, set the step time (at hidden 1024 and 2048 tokens
# per microbatch the H200 step was host-bound: ~0.9 s for ~30 TFLOP).
BASE = ["model.num_layers=16", "model.layer_pattern=KKKM", "model.dense_layers=16", "model.hidden_size=2048",
        "model.kda.num_heads=16", "model.kda.head_dim=128", "model.mla.num_heads=16",
        "model.mla.qk_nope_head_dim=128", "model.mla.qk_rope_head_dim=64", "model.mla.v_head_dim=128",
        "model.mla.q_lora_rank=768", "model.mla.kv_lora_rank=512", "model.ffn.intermediate_size=6144",
        "model.attnres.block_size=2", "train.seq_len=4096", "train.micro_batch_size=1",
        "train.microbatches=8", "logging.wandb.mode=disabled", "logging.progress_bar=false"]
SMALL = ["model.num_layers=8", "model.dense_layers=8", "model.hidden_size=64", "model.kda.num_heads=2",
         "model.kda.head_dim=32", "model.mla.num_heads=2", "model.mla.qk_nope_head_dim=16",
         "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16", "model.mla.q_lora_rank=32",
         "model.mla.kv_lora_rank=32", "model.ffn.intermediate_size=128", "train.seq_len=64",
         "train.microbatches=8"]
# Big enough on CPU that compute, not the host, sets the step time (a cross-check of GPU figures).
MEDIUM = ["model.num_layers=8", "model.dense_layers=8", "model.hidden_size=256", "model.kda.num_heads=2",
          "model.kda.head_dim=64", "model.mla.num_heads=2", "model.mla.qk_nope_head_dim=32",
          "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=32", "model.mla.q_lora_rank=64",
          "model.mla.kv_lora_rank=64", "model.ffn.intermediate_size=1024", "train.seq_len=256",
          "train.micro_batch_size=2", "train.microbatches=8"]
VARIANTS = {"attnres_cached": ["model.attnres.enabled=true", "pipeline.attnres_transport=cached"],
            "attnres_naive": ["model.attnres.enabled=true", "pipeline.attnres_transport=naive"],
            "standard": ["model.attnres.enabled=false"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny widths: a smoke test of the script")
    ap.add_argument("--medium", action="store_true", help="hidden 256, seq 256, 8 layers: a CPU cross-check")
    ap.add_argument("--vpp", default="1,2,4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    from megatron.core import parallel_state

    from k3train.config import load_config
    from k3train.runtime.cuda_env import prepare_cuda_env
    from k3train.runtime.distributed import init_distributed
    from k3train.trainer.data import build_data
    from k3train.trainer.state import TrainState
    from pipeline import CommRecorder

    results, compiled = [], []
    size = SMALL if args.small else MEDIUM if args.medium else []
    for vpp in map(int, args.vpp.split(",")):
        # All three variants of one V live at once and step in turns (round r: cached, naive,
        # standard), so drift on the machine (clocks, the allocator, a neighbour) hits them alike.
        cfgs = {name: load_config("configs/k3_tiny.yaml", [*BASE, *size, *extra, "parallel.pp=2",
                                                             f"parallel.vpp={vpp}", f"train.device={args.device}"])
                for name, extra in VARIANTS.items()}
        first = next(iter(cfgs.values()))
        prepare_cuda_env(first)  # before CUDA starts (the first V): see k3train/runtime/cuda_env.py
        info = init_distributed(1, 2, vpp, 1, args.device)  # one set of groups for the V's variants
        dev = torch.device(args.device, info.local_rank) if args.device == "cuda" else torch.device("cpu")
        if not compiled:
            # Compile every Triton kernel and autotune candidate once, in parallel, on a
            # throwaway copy (its hops must not count in the recorder); all variants share them.
            compiled.append(TrainState(first, info, dev).compile_kernels())
        runs = {}
        for name, cfg in cfgs.items():
            recorder = CommRecorder()
            runs[name] = (TrainState(cfg, info, dev, recorder=recorder), recorder,
                          build_data(cfg, parallel_state.get_data_parallel_rank(), info.dp), [])
        for step in range(args.steps + 2):
            for state, _recorder, data, times in runs.values():
                batch = next(data.train)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                state.train_step(batch)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                if step >= 2:  # the first steps agree shapes and (on GPU) autotune kernels
                    times.append(time.perf_counter() - t0)
        for name, (_state, recorder, _data, times) in runs.items():
            recorder.gather(parallel_state.get_pipeline_model_parallel_group())
            if info.is_main:
                table, bubble = recorder.bytes_table(), recorder.bubble_fraction()
                results.append({"variant": name, "vpp": vpp, "step_ms": statistics.median(times) * 1e3,
                                "fwd_bytes": table["measured_fwd"], "bubble": bubble["measured"],
                                "bubble_theory": bubble["theory"]})
                print(json.dumps(results[-1]), flush=True)
        del runs
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if results:
        std = {r["vpp"]: r["step_ms"] for r in results if r["variant"] == "standard"}
        print(f"\n{'variant':<16}{'V':>3}{'step ms':>10}{'vs standard':>13}{'fwd MB':>9}{'bubble':>8}{'(P-1)/(Vm)':>11}")
        for r in results:
            r["overhead_vs_standard"] = r["step_ms"] / std[r["vpp"]] - 1
            print(f"{r['variant']:<16}{r['vpp']:>3}{r['step_ms']:>10.1f}{r['overhead_vs_standard']:>+12.1%}"
                  f"{r['fwd_bytes'] / 2**20:>9.1f}{r['bubble']:>8.3f}{r['bubble_theory']:>11.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    # Tear the groups down explicitly: on 2x H200 the process printed its results, then did not
    # exit until killed (NCCL communicators with p2p history left to interpreter exit).
    from k3train.runtime.distributed import shutdown_distributed

    torch.distributed.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    main()
