"""How long a checkpoint save stops training: a synchronous save against ``train.async_save``,
side by side in one run, on the K3 slice (configs/k3_slice.yaml: 6.5B parameters on one H200).

    python3 -m benchmarks.bench_save_stall --out /path/with/room [--modes sync,async] [--json OUT]
    python3 -m benchmarks.bench_save_stall --device cpu --small --seq 32 --microbatches 2 --out /tmp/s

One model (``TrainState``, as ``k3train train`` builds it), random batches, and these phases:

* ``step_ms``: the median training step without a save (after one warm-up step that compiles);
* ``sync``: ``CheckpointWriter(asynchronous=False).save``, what every save cost before
  ``train.async_save``: training stops for the whole write (``stall_s``);
* ``async``: ``CheckpointWriter(asynchronous=True).save``: training stops only for the host
  snapshot (``stall_s``, the call's return; the first save also allocates the writer's pinned
  host buffers, k3train/trainer/host_buffers.py); then training steps run while the background
  thread writes (``steps_during_write`` and their median ``step_ms_during_write``, which shows
  what the write's host copy and disk traffic cost the steps), and ``wait_s`` is what is left of
  the write after those steps (the loop waits there at the next save, a signal or its end);
  ``next_stall_s``: a later save's stop, its snapshot into the kept buffers (timed without a
  second write, which would repeat the first one's disk time).

Both saves write the same step's state (``bytes``), each into its own directory, and the
synchronous one is deleted before the asynchronous one starts, so the disk needs room for one
checkpoint (about 40 GiB for the slice with Muon in fp32, see docs/k3_slice.md); ``--out`` must
be on the disk that checkpoints go to (the write rate is the disk's). The goal of
``train.async_save``: ``async.stall_s`` a few seconds (the host copy), against minutes for
``sync.stall_s`` at K3 scale.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.bench_step import SMALL  # noqa: E402
from benchmarks.common import save_json  # noqa: E402
from k3train.config import load_config  # noqa: E402
from k3train.ops import kernels  # noqa: E402
from k3train.runtime.distributed import init_distributed  # noqa: E402
from k3train.trainer.async_save import CheckpointWriter  # noqa: E402
from k3train.trainer.state import TrainState  # noqa: E402
from k3train.trainer.state_io import rank_state  # noqa: E402

warnings.filterwarnings("ignore")

LAYOUT = {"world_size": 1, "rank": 0, "local_rank": 0, "tp": 1, "pp": 1, "vpp": 1, "ep": 1, "dp": 1, "zero1": False}
COORDS = {"pp": 0, "tp": 0, "ep": 0, "dp": 0}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(args) -> dict:
    overrides = [*(SMALL + ["model.dense_layers=0"] if args.small else []), f"train.device={args.device}",
                 f"train.micro_batch_size={args.mbs}", f"train.seq_len={args.seq}",
                 f"train.microbatches={args.microbatches}", "train.cuda_graph=false", *args.override]
    cfg = load_config(args.config, overrides)
    kernels.apply(cfg)   # the config's kernels: section (an --override kernels.autotune=fixed acts)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device=args.device), dev)
    state.compile_kernels()
    g = torch.Generator().manual_seed(0)
    batch = lambda: torch.randint(0, cfg.model.vocab_size, (args.mbs * args.microbatches, args.seq + 1),  # noqa: E731
                                  generator=g)
    step = lambda: state.train_step(batch())  # noqa: E731
    _timed(step, args.device)  # warm-up: compiles and autotunes
    step_s = statistics.median(_timed(step, args.device) for _ in range(args.steps))
    # A new directory of the benchmark's own inside --out: only what it wrote is removed after.
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="bench_save_stall-", dir=args.out))
    result = {"config": args.config, "device": args.device, "step_ms": step_s * 1e3,
              "params": sum(p.numel() for p in state.params)}

    if "sync" in args.modes:
        sync_writer = CheckpointWriter(asynchronous=False)
        sync_dir = out / "sync"
        result["sync"] = {"stall_s": _timed(lambda: sync_writer.save(
            sync_dir, 1, lambda: rank_state(state, 1, {}), layout=LAYOUT, keep_last=1, coords=COORDS), args.device)}
        result["sync"]["bytes"] = _bytes(sync_dir)
        shutil.rmtree(sync_dir)  # room for the next one
    if "async" not in args.modes:
        shutil.rmtree(out)
        return result

    async_writer = CheckpointWriter(asynchronous=True)
    async_dir = out / "async"
    stall = _timed(lambda: async_writer.save(async_dir, 1, lambda: rank_state(state, 1, {}, host=async_writer.host),
                                             layout=LAYOUT, keep_last=1, coords=COORDS), args.device)
    during = []
    while async_writer.in_flight and len(during) < args.max_steps_during_write:
        during.append(_timed(step, args.device))
    wait_s = _timed(async_writer.wait, args.device)
    result["async"] = {"stall_s": stall, "steps_during_write": len(during),
                       "step_ms_during_write": statistics.median(during) * 1e3 if during else None,
                       "wait_s": wait_s, "bytes": _bytes(async_dir), "host_buffer_bytes": async_writer.host.nbytes}
    # A later save stops training for its snapshot alone (save() = wait for the previous write,
    # none here, then this), into the buffers the first save allocated: timed without a second
    # write, which would only repeat the first one's disk time.
    step()
    result["async"]["next_stall_s"] = _timed(lambda: rank_state(state, 2, {}, host=async_writer.host), args.device)
    shutil.rmtree(out)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_slice.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU dry run)")
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=16, help="per update (16 x 4096 = 64K tokens)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps without a save, after one warm-up")
    ap.add_argument("--max-steps-during-write", type=int, default=50,
                    help="at most this many steps while the background save writes")
    ap.add_argument("--out", required=True, help="a directory on the checkpoint disk, room for one checkpoint")
    ap.add_argument("--modes", default="sync,async", type=lambda v: v.split(","),
                    help="comma list of sync, async (sync: the whole write stops training)")
    ap.add_argument("--override", nargs="*", default=[], metavar="key.sub=value")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bad = sorted(set(args.modes) - {"sync", "async"})
    if bad:
        ap.error(f"--modes: {','.join(bad)} is not a mode; allowed: sync, async")
    r = measure(args)
    gib = r[args.modes[0]]["bytes"] / 2**30
    print(f"{r['config']} on {r['device']}: {r['params'] / 1e9:.2f}B parameters, step {r['step_ms']:.0f} ms, "
          f"checkpoint {gib:.1f} GiB")
    if "sync" in r:
        print(f"  sync save : training stopped {r['sync']['stall_s']:.2f} s "
              f"({gib / max(r['sync']['stall_s'], 1e-9):.2f} GiB/s)")
    if "async" in r:
        a = r["async"]
        during = "-" if a["step_ms_during_write"] is None else f"{a['step_ms_during_write']:.0f} ms"
        print(f"  async save: training stopped {a['stall_s']:.2f} s (host snapshot, allocating its buffers); "
              f"{a['steps_during_write']} step(s) ran during the write (median {during}); {a['wait_s']:.2f} s "
              f"of the write left after them")
        print(f"  a later async save: training stops {a['next_stall_s']:.2f} s (snapshot into the kept "
              f"{a['host_buffer_bytes'] / 2**30:.1f} GiB of host buffers, "
              f"{a['host_buffer_bytes'] / 2**30 / max(a['next_stall_s'], 1e-9):.1f} GiB/s)")
    save_json(args.json, r)


if __name__ == "__main__":
    main()
