"""Getting fla's Triton kernels compiled fast: compile ahead in parallel, optionally one config each.

Why this exists: fla autotunes most kernels over 3-36 configurations, and Triton compiles every
candidate one after another on first use. A KDA forward+backward touches about 20 kernels; on
the GPU machines we borrow one compile takes about 8 s, so a fresh process spent many minutes
compiling before its first step.

* ``compile_ahead(fn)`` runs ``fn`` once with every Triton launch replaced by a compile submitted
  to a thread pool (Triton's ``AsyncCompileMode``; compiles overlap: ptxas is a subprocess, and
  two threads compiled 1.6x faster than one in a CPU-only test), so all kernels and all their
  autotune candidates compile at once. The kernels do not run inside ``fn``: its outputs are
  garbage, so ``fn`` must not change state you keep (a forward/backward whose gradients you
  drop, as ``TrainState.compile_kernels`` does; never an optimizer step). Afterwards
  the compiled kernels sit in the in-process and on-disk Triton caches, and the real run only
  benchmarks the candidates (milliseconds each) and goes. Where an earlier run's autotune
  result is on disk (Triton's ``cache_results``, on in fla), only the chosen candidate compiles.
* Where this GPU model's autotune picks are known (``kernels.autotune_picks``; see
  ``k3train.ops.autotune_picks``), only the picked candidate compiles and nothing is timed.
* ``kernels.autotune=fixed`` (the run's config) keeps one candidate per autotuned kernel: the one with the
  smallest tiles, fewest stages and warps, which fits every shape's shared memory. For
  correctness runs, where kernel speed does not matter. ``full`` (default) leaves the
  candidates as fla's authors set them, each timed for ``kernels.autotune_bench_ms`` (25 ms,
  not Triton's 125: that window was most of a fresh run's step 1); use it for every speed figure.

Both are no-ops where Triton is not installed (CPU-only machines).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from k3train.ops import autotune_picks
from k3train.ops import backends as ops_backends

_state = {"configured": False, "compile_only": False}


def _triton():
    """(autotuner, jit, _async_compile) modules of the installed Triton, or None without Triton.
    ``_async_compile`` is None on Triton versions before it existed (3.6 has it): compiling
    ahead is then skipped and kernels compile on first use."""
    try:
        import triton  # noqa: F401
        from triton.runtime import autotuner, jit
    except ImportError:
        return None
    try:
        from triton.runtime import _async_compile
    except ImportError:
        _async_compile = None
    return autotuner, jit, _async_compile


def smallest_config(configs: list):
    """The candidate using the least on-chip resources: tile product, then stages, then warps."""
    def cost(c):
        tiles = math.prod(v for v in c.kwargs.values() if isinstance(v, int) and v > 0)
        return (tiles, c.num_stages, c.num_warps)
    return min(configs, key=cost)


def configure_autotune() -> str:
    """Put the ``kernels.autotune`` switch into every Triton autotuner (fla's included); returns
    the mode in force.

    Patches the ``Autotuner`` class once per process, so it covers kernels imported before and
    after the call; the patch asks ``k3train.ops.ops_backends.current().autotune`` at each pruning, so the
    run's config decides (``full`` leaves the candidates as their authors set them)."""
    mods = _triton()
    if mods is None or _state["configured"]:
        return ops_backends.current().autotune
    autotuner = mods[0].Autotuner
    prune = autotuner.prune_configs

    def prune_by_mode(self, kwargs):
        configs = prune(self, kwargs)
        if ops_backends.current().autotune == "fixed":
            return [smallest_config(configs)]
        autotune_picks.note_tuner(self)
        if len(configs) > 1:
            # A pick recorded on this GPU model (kernels.autotune_picks): only it compiles and
            # nothing is timed; a launch the picks do not cover is tuned as usual.
            chosen = autotune_picks.pick(self, kwargs, configs, autotune_picks.table(ops_backends.current().autotune_picks))
            if chosen is not None:
                return [chosen]
        announce_autotune(self, len(configs))
        set_bench_window(self, ops_backends.current().autotune_bench_ms)
        return configs

    autotuner.prune_configs = prune_by_mode
    _state["configured"] = True
    return ops_backends.current().autotune


def set_bench_window(tuner, ms: float) -> None:
    """Time ``tuner``'s candidates for ``ms`` each (warm-up ``ms / 5``) instead of Triton's
    25 + 100 ms, unless the kernel brought its own benchmark function or ``ms`` is 0.

    Called right before the tuner benchmarks (from the pruning hook). The tuner reads its
    benchmark function as ``self.do_bench`` (a cached property in Triton 3.x), so an entry in
    the instance's dict takes its place."""
    if ms <= 0 or getattr(tuner, "_do_bench", None) is not None:
        return
    from triton import testing

    def bench(kernel_call, quantiles):
        return testing.do_bench(kernel_call, warmup=ms / 5, rep=ms, quantiles=quantiles)

    tuner.__dict__["do_bench"] = bench


def kernel_label(jit_fn) -> str:
    """``package.kernel_name`` of a Triton ``JITFunction`` (``fla.chunk_kda_fwd_kernel_o``), for
    progress lines."""
    fn = autotune_picks.python_function(jit_fn)
    module = getattr(fn, "__module__", "") or ""
    name = getattr(fn, "__name__", None) or type(jit_fn).__name__
    return f"{module.split('.')[0]}.{name}" if module else name


def announce_autotune(tuner, n_configs: int, out=None) -> None:
    """Print "autotuning KERNEL (N configs)" the first time a kernel is tuned in this process.
    Triton prunes right before it benchmarks a new shape, so this is what a silent first step
    waits for (issue 22); later shapes of the same kernel stay quiet."""
    if n_configs < 2 or _state["compile_only"]:  # compile-ahead has its own progress line
        return
    label = kernel_label(tuner)
    if label in _announced:
        return
    _announced.add(label)
    print(f"[k3train] autotuning {label} ({n_configs} configs) ...", file=out or sys.stderr, flush=True)


_announced: set[str] = set()


@contextlib.contextmanager
def _launches_compile_only(mode=None, names: dict | None = None):
    """Inside: a Triton launch compiles (all autotune candidates) and returns without running.
    ``names`` (with ``mode``, the active ``AsyncCompileMode``) collects, for each compile future
    submitted, the label of the kernel it compiles: the progress line names what is pending."""
    autotuner_mod, jit_mod, _ = _triton()
    Autotuner, JITFunction = autotuner_mod.Autotuner, jit_mod.JITFunction
    jit_run, tuner_run = JITFunction.run, Autotuner.run

    active = getattr(_triton()[2], "active_mode", None) if mode is not None else None

    def compile_only(self, *args, grid, warmup, **kwargs):
        before = len(mode.raw_futures) if names is not None else 0
        # Triton's async mode is a ContextVar, set in the thread that entered it. The autograd
        # engine runs CUDA backward in its own thread, where it is unset, so every backward
        # kernel compiled synchronously, one candidate after another (issue 22: two minutes
        # after the forward's compiles ended). Set it for this launch in whatever thread.
        token = active.set(mode) if active is not None and active.get() is None else None
        try:
            return jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            if token is not None:
                active.reset(token)
            if names is not None:
                for future in mode.raw_futures[before:]:
                    names[future] = kernel_label(self)

    def compile_candidates(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        try:
            configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
            if len(configs) > 1 and getattr(self, "cache_results", False):
                best = _cached_choice(self, configs, kwargs)
                configs = configs if best is None else [best]
            for cfg in configs:
                self.fn.run(*args, **kwargs, **cfg.all_kwargs())
        finally:
            self.nargs = None

    JITFunction.run, Autotuner.run = compile_only, compile_candidates
    _state["compile_only"] = True
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = jit_run, tuner_run
        _state["compile_only"] = False


def _load_modules(future_kernels) -> None:
    """Load every compiled kernel onto the current GPU now rather than at its first launch.

    Loading a module while NCCL kernels spin waiting for a peer can stall the device, and in
    a pipeline step p2p kernels are in flight at every first launch; loading here, before the
    step, also takes that time out of step 1. A candidate too big for this GPU raises
    OutOfResources here and again at launch, where the autotuner skips it."""
    for future in future_kernels:
        kernel = future.result(ignore_errors=True)
        if kernel is None:
            continue
        try:
            kernel._init_handles()
        except Exception:  # noqa: BLE001 - see the docstring: the launch reports it
            pass


class _NotCached(Exception):
    pass


def _cached_choice(tuner, configs: list, kwargs: dict):
    """The candidate an earlier run's autotuning picked for this call (Triton keeps the timings
    on disk when ``cache_results`` is set, as fla sets it), or None. Only it needs compiling."""
    key = autotune_picks.tuning_key(tuner, kwargs)
    if key in tuner.cache:
        return tuner.cache[key]

    def miss():
        raise _NotCached

    try:  # the same lookup Autotuner.run makes; a miss would benchmark, so stop it there
        return tuner.cache[key] if tuner.check_disk_cache(key, configs, miss) else None
    except _NotCached:
        return None


def progress_line(futures: list, names: dict, seconds: float, show: int = 3) -> str:
    """One progress line: finished compiles of those submitted, and what is still pending, by
    kernel (``names``: future -> kernel label) -- or, when every compile has finished, that the
    pass itself is still running (torch.compile of the fused pieces, the model's host code)."""
    done = sum(f.done() for f in futures)
    line = f"[k3train]   {done}/{len(futures)} Triton compiles done ({seconds:.0f} s)"
    pending: dict[str, int] = {}
    for f in futures:
        if not f.done():
            label = names.get(f, "unnamed kernel")
            pending[label] = pending.get(label, 0) + 1
    if not futures or not pending:
        return line + "; still running the compile pass (torch.compile of fused ops, host code)"
    most = sorted(pending.items(), key=lambda kv: -kv[1])
    parts = [f"{label} ({n} config{'s' if n > 1 else ''})" for label, n in most[:show]]
    more = f" and {len(most) - show} more kernels" if len(most) > show else ""
    return line + "; waiting on " + ", ".join(parts) + more


@contextlib.contextmanager
def _progress(mode, t0: float, every: float = 15.0, out=None, names: dict | None = None):
    """While inside, print a ``progress_line`` every ``every`` s (a first compile of a model can
    take minutes; the user should see it move, and what it waits for)."""
    stop = threading.Event()

    def report():
        while not stop.wait(every):
            print(progress_line(list(mode.raw_futures), names or {}, time.perf_counter() - t0),
                  file=out or sys.stderr, flush=True)

    thread = threading.Thread(target=report, daemon=True, name="k3train-compile-progress")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def compile_ahead(fn, threads: int | None = None, label: str = "") -> dict:
    """Compile every Triton kernel ``fn`` would launch, in parallel, without running them.

    ``fn``: a throwaway callable (its tensors come out uninitialised). Returns ``{"kernels": n,
    "seconds": s}``; prints a line when it starts, progress every 15 s, and the total. Errors
    inside ``fn`` are reported, not raised: the kernels it did not reach compile lazily in the
    real run, as they would without this."""
    mods = _triton()
    if mods is None or mods[2] is None:
        return {"kernels": 0, "seconds": 0.0}
    import torch

    threads = threads or os.cpu_count() or 4
    t0 = time.perf_counter()
    mode_name = configure_autotune()
    picks = autotune_picks.source(ops_backends.current().autotune_picks) if mode_name == "full" else None
    print(f"[k3train] compiling Triton kernels ahead{' for ' + label if label else ''} "
          f"({threads} threads, autotune={mode_name}{', picks from ' + picks if picks else ''}) ...",
          file=sys.stderr, flush=True)
    with ThreadPoolExecutor(threads) as pool:
        mode = mods[2].AsyncCompileMode(pool, ignore_errors=True)
        names: dict = {}
        with _progress(mode, t0, names=names), _launches_compile_only(mode, names), mode:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the real run compiles what was not reached
                print(f"[k3train] compile-ahead stopped early ({type(exc).__name__}: {exc}); "
                      "the rest compiles on first use", file=sys.stderr, flush=True)
        n = len(mode.future_kernels)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        _load_modules(mode.future_kernels.values())
    secs = time.perf_counter() - t0
    print(f"[k3train] compiled {n} Triton kernels in {secs:.1f} s", file=sys.stderr, flush=True)
    return {"kernels": n, "seconds": secs}
