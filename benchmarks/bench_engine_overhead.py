"""What the pipeline engine adds on one device: a plain step against the engine at P=1, V=1,2,4.

    python3 -m benchmarks.bench_engine_overhead [--shape tiny|medium|pipeline] [--device cpu|cuda]
        [--vpp 1,2,4] [--steps N] [--profile] [--kernels] [--graph] [--json OUT]

At P = 1 the engine runs the same code with C = V chunks on one rank: every hop is a local
hand-over, so whatever it costs over a plain step is the engine's own work (schedule walk,
StageIO hand-overs, AttnRes block cache puts and drops, gradient deposits, one autograd call
per op instead of one per microbatch). Side by side in one run, for the standard residual and
for AttnRes with the cached transport, with the same weights (chunks and the whole model draw
their parameters from the same seeded streams) and the same m = 8 microbatches:

* ``plain``: the whole model, gradient accumulation over the microbatches (the trainer's pp=1 path);
* ``engine V=v``: ``k3train.trainer.parts.build_pipeline_parts`` at pp=1, vpp=v.

Timed: forward and backward of the m microbatches (gradients set to None before each step, no
optimizer: it is the same for both). The runners of one residual variant step in turns, so
drift hits them alike; each round shuffles their order (seeded), so that none has a fixed
place or predecessor, and Python's garbage collector is held off while a step is timed. Each
runner's ratio to the plain step is taken round by round (the two steps of one turn) and
summarised by its median and interquartile range over the rounds. A second plain runner,
``plain (A/A)``, takes its turn like the others: its ratio to the first is the noise floor of
the run, what an engine ratio must be read against. Prints step times, engine/plain per V, and the AttnRes cost
(attnres/standard) under the engine next to the plain step's. ``--profile`` prints the top
host-side costs of one engine step at the largest V: the engine's own Python functions by self
time (cProfile) and the aten operators whose call count differs from the plain step.
``--kernels`` profiles one more step of every runner and prints its CUDA kernels' summed time,
kernel launches and host self time: the kernel-time ratio to the plain step is the GPU work the
engine adds, measured without the host's jitter (on CPU only launches and host time).
``--graph`` (CUDA) replays every runner's step from its own CUDA graph, as ``train.cuda_graph``
does for the plain step: the engine at P=1 has no communication, so its whole step captures,
and the comparison is then of GPU work and the engine's effect on it, without launch time.

Shapes: ``pipeline`` is bench_pipeline.py's model (hidden 2048, seq 4096, 16 layers: one H200);
``tiny`` (hidden 64, seq 64) shows the host overhead on CPU; ``medium`` (hidden 256, seq 256) a
CPU step where compute dominates.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import statistics
import time
import warnings

import torch

from benchmarks.bench_pipeline import BASE, MEDIUM, SMALL  # noqa: E402  (the pipeline benchmark's model)

from k3train.profiling.predict import device_work, profiled_events  # noqa: E402

warnings.filterwarnings("ignore")

SHAPES = {"tiny": SMALL, "medium": MEDIUM, "pipeline": []}
VARIANTS = {"standard": ["model.attnres.enabled=false"],
            "attnres_cached": ["model.attnres.enabled=true", "pipeline.attnres_transport=cached"]}


class Runner:
    """One way of running the step: ``step()`` does forward+backward of every microbatch."""

    def __init__(self, name, module, step_fn):
        self.name, self.module, self.step_fn, self.times, self.loss = name, module, step_fn, [], None
        self.graphed = None

    def use_graph(self, device):
        """Replay the step from a CUDA graph (the trainer's ``GraphedForwardBackward``: two eager
        calls, the third captured, every later one replayed), so that host launch time drops
        out of the comparison. Each runner gets its own graph and memory pool."""
        from k3train.trainer.cuda_graph import GraphedForwardBackward

        fn = self.step_fn
        self.graphed = GraphedForwardBackward(lambda batch: fn(), list(self.module.parameters()), [])
        self._token = torch.zeros(1, 1, dtype=torch.long, device=device)  # the replay's (unused) batch

    def step(self):
        for p in self.module.parameters():
            p.grad = None
        self.loss = self.step_fn() if self.graphed is None else self.graphed(self._token)


def build_runners(cfg_for, vpps, device, parallel):
    from k3train.model.model import build_model
    from k3train.trainer.parts import build_pipeline_parts
    from k3train.trainer.state import autocast_for

    cfg = cfg_for(1)
    autocast = autocast_for(cfg, device)
    m = cfg.train.microbatches

    def batches(c):
        g = torch.Generator().manual_seed(0)
        toks = torch.randint(0, c.model.vocab_size, (c.train.micro_batch_size * m, c.train.seq_len + 1),
                             generator=g).to(device)
        return [(mb[:, :-1], mb[:, 1:]) for mb in toks.chunk(m)]

    mbs = batches(cfg)
    model = build_model(cfg).to(device)

    def plain():
        # The trainer's pp=1 path (k3train/trainer/state.py): gradient accumulation.
        total = torch.zeros((), device=device)
        for x, y in mbs:
            with autocast:
                loss = model(x, y)
            (loss / m).backward()
            total += loss.detach() / m
        return total

    runners = [Runner("plain", model, plain)]
    control = Runner("plain (A/A)", model, plain)  # the same step again: the run's noise floor
    for v in vpps:
        chunks, engine = build_pipeline_parts(cfg_for(v), device, parallel)

        def run(engine=engine):
            with autocast:
                return engine.train_step(mbs)

        runners.append(Runner(f"engine V={v}", chunks, run))
    return runners + [control]


def round_orders(num_runners: int, rounds: int, seed: int = 0) -> list[list[int]]:
    """The order the runners step in, per round: a seeded shuffle each round. A fixed order
    gave the first runner of every round a slower step (on CPU the A/A control ran at 0.955 of
    the plain step before it); starting each round at the next runner still kept every runner
    behind the same predecessor, and on an H200 the control, nearly always right after the heaviest
    runner (engine V=4), read 1.064. Shuffled, no runner has a fixed place or neighbour."""
    rng = random.Random(seed)
    return [rng.sample(range(num_runners), num_runners) for _ in range(rounds)]


def time_runners(runners, steps, device, untimed: int = 2):
    for i, order in enumerate(round_orders(len(runners), steps + untimed)):
        # (the first rounds are untimed: shapes agreed, kernels compiled and tuned; with
        # graphs, the two eager warm-ups and the capture)
        for r in (runners[j] for j in order):
            if device.type == "cuda":
                torch.cuda.synchronize()
            gc.collect()
            gc.disable()             # a collection inside one runner's step would charge it alone
            try:
                t0 = time.perf_counter()
                r.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            finally:
                gc.enable()
            if i >= untimed:
                r.times.append(dt)


def paired_ratio(times, base):
    """Round-by-round ratios ``times[i] / base[i]``: their median and quartiles ``(q1, median, q3)``."""
    ratios = sorted(t / b for t, b in zip(times, base))
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q2, q3


def profile_host(runner, plain, rows=15):
    """Top host-side costs of one engine step: the engine's Python functions by self time, and
    the aten ops whose counts differ from the plain step (what the engine adds per step)."""
    prof = cProfile.Profile()
    prof.enable()
    runner.step()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    own = [(v[2], v[0], k) for k, v in st.stats.items() if "/pipeline/" in k[0]]
    own.sort(reverse=True)
    print(f"\n--profile: {runner.name}, host self time of the engine's own functions "
          f"({sum(t for t, _, _ in own) * 1e3:.2f} ms of {total * 1e3:.1f} ms in Python-visible calls)")
    print(f"{'self ms':>9}{'calls':>7}  function")
    for t, n, (f, line, fn) in own[:rows]:
        print(f"{t * 1e3:>9.3f}{n:>7}  {f.rsplit('/', 2)[-2]}/{f.rsplit('/', 1)[-1]}:{line} {fn}")

    from torch.profiler import ProfilerActivity, profile

    def op_counts(r):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            r.step()
        return {e.key: (e.count, e.self_cpu_time_total) for e in p.key_averages()}

    a, b = op_counts(plain), op_counts(runner)
    diff = [(b[k][1] - a.get(k, (0, 0))[1], k, a.get(k, (0, 0))[0], b[k][0]) for k in b
            if b[k][0] != a.get(k, (0, 0))[0]]
    diff.sort(reverse=True)
    print(f"\naten ops whose call count differs (plain -> {runner.name}), by added host self time")
    print(f"{'+self ms':>9}{'plain':>7}{'engine':>8}  op")
    for dt, k, na, nb in diff[:rows]:
        print(f"{dt / 1e3:>9.3f}{na:>7}{nb:>8}  {k}")


def profile_work(runner) -> dict:
    """``device_work`` (k3train.profiling.predict) of one more step of ``runner`` under torch.profiler."""
    return device_work(profiled_events(runner.step, torch.cuda.is_available()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="pipeline")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vpp", default="1,2,4", help="engine chunk counts V (comma-separated)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per runner (after 2 untimed)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"residual variants, of {list(VARIANTS)}")
    ap.add_argument("--profile", action="store_true", help="print the engine's top host-side costs")
    ap.add_argument("--graph", action="store_true",
                    help="every runner replays its step from a CUDA graph (CUDA only): the engine's cost "
                         "without the host's launch time")
    ap.add_argument("--kernels", action="store_true",
                    help="one more profiled step per runner: GPU kernel time, launches, host time")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.graph and args.device != "cuda":
        ap.error("--graph replays CUDA graphs: it needs --device cuda")
    vpps = [int(v) for v in args.vpp.split(",")]
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}; choose from {list(VARIANTS)}")
    from k3train.config import load_config
    from k3train.runtime.cuda_env import prepare_cuda_env
    from k3train.runtime.distributed import init_distributed, parallel_context, shutdown_distributed

    def cfg_for(variant):
        return lambda v: load_config("configs/k3_tiny.yaml", [
            *BASE, *SHAPES[args.shape], *VARIANTS[variant], "parallel.pp=1", f"parallel.vpp={v}",
            f"train.device={args.device}"])

    prepare_cuda_env(cfg_for(variants[0])(1))
    info = init_distributed(1, 1, 1, 1, args.device)
    parallel = parallel_context(info)
    device = torch.device(args.device)
    results = []
    for variant in variants:
        runners = build_runners(cfg_for(variant), vpps, device, parallel)
        if device.type == "cuda":
            from k3train.ops import kernels
            from k3train.ops.triton_compile import compile_ahead
            if kernels.uses_triton(device):
                compile_ahead(runners[0].step, label="the plain step")
        if args.graph:
            for r in runners:
                r.use_graph(device)
        print(f"[{variant}] timing {[r.name for r in runners]} x {args.steps} steps"
              f"{' (CUDA graphs)' if args.graph else ''} ...", flush=True)
        time_runners(runners, args.steps, device, untimed=3 if args.graph else 2)
        plain = runners[0]
        for r in runners:
            ms = statistics.median(r.times) * 1e3
            q1, q2, q3 = paired_ratio(r.times, plain.times)
            results.append({"variant": variant, "runner": r.name, "step_ms": ms, "min_ms": min(r.times) * 1e3,
                            "times_ms": [t * 1e3 for t in r.times],
                            "paired_ratio": q2, "paired_ratio_q1": q1, "paired_ratio_q3": q3,
                            "loss_rel_diff": abs(r.loss.item() / plain.loss.item() - 1)})
            print(json.dumps(results[-1]), flush=True)
        if args.kernels:
            work = {r.name: profile_work(r) for r in runners}
            for row in results[-len(runners):]:
                row["work"] = work[row["runner"]]
        if args.profile:
            profile_host(runners[-1], plain)
        del runners, plain
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ms = {(r["variant"], r["runner"]): r["step_ms"] for r in results}
    fastest = {(r["variant"], r["runner"]): r["min_ms"] for r in results}
    # The minimum beside the median: on a shared host (CPU runs) the median still carries the
    # neighbours' load, the fastest step is the closest to the code's own cost.
    print(f"\nshape={args.shape} device={args.device} m=8, forward+backward per step "
          f"(median and min of {args.steps}); loss diff: |engine/plain - 1| of the step's loss")
    print(f"{'variant':<16}{'runner':<13}{'median ms':>10}{'engine/plain':>14}{'min ms':>10}"
          f"{'engine/plain':>14}{'paired ratio [q1, q3]':>25}{'loss diff':>11}")
    for r in results:
        r["engine_over_plain"] = r["step_ms"] / ms[(r["variant"], "plain")]
        r["engine_over_plain_min"] = r["min_ms"] / fastest[(r["variant"], "plain")]
        pair = f"{r['paired_ratio']:.3f} [{r['paired_ratio_q1']:.3f}, {r['paired_ratio_q3']:.3f}]"
        print(f"{r['variant']:<16}{r['runner']:<13}{r['step_ms']:>10.2f}{r['engine_over_plain']:>14.3f}"
              f"{r['min_ms']:>10.2f}{r['engine_over_plain_min']:>14.3f}{pair:>25}{r['loss_rel_diff']:>11.1e}")
    print("paired ratio: median over rounds of (runner's step / the plain step of the same round), with "
          "its quartiles; plain (A/A) is the plain step run again, the noise floor")
    if args.kernels:
        base = {r["variant"]: r["work"] for r in results if r["runner"] == "plain"}
        print("\n--kernels: one profiled step per runner (kernel time is free of host jitter)")
        if args.graph:
            # A replay issues one graph launch, no kernel launches, and the host's time is its
            # wait for the replay: only the kernel column measures anything here.
            print("(replayed from CUDA graphs: launches count kernel launches, none in a replay; "
                  "host self time is the wait for the replay)")
        print(f"{'variant':<16}{'runner':<13}{'GPU kernels ms':>15}{'engine/plain':>14}{'launches':>10}"
              f"{'host self ms':>14}")
        for r in results:
            w, b = r["work"], base[r["variant"]]
            ratio = w["kernel_ms"] / b["kernel_ms"] if w["kernel_ms"] and b["kernel_ms"] else float("nan")
            r["kernel_over_plain"] = ratio
            kms = f"{w['kernel_ms']:.2f}" if w["kernel_ms"] is not None else "-"
            print(f"{r['variant']:<16}{r['runner']:<13}{kms:>15}{ratio:>14.3f}{w['launches']:>10}"
                  f"{w['host_ms']:>14.1f}")
    summary = {}
    if len(variants) == 2:
        print("\nAttnRes cost (attnres_cached / standard), same runner:")
        for runner in ["plain"] + [f"engine V={v}" for v in vpps]:
            summary[runner] = ms[("attnres_cached", runner)] / ms[("standard", runner)]
            print(f"  {runner:<12}{summary[runner]:>7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": args.device, "steps": args.steps, "graph": args.graph,
                       "results": results, "attnres_over_standard": summary}, f, indent=1)
    shutdown_distributed()


if __name__ == "__main__":
    main()
