"""Compile-ahead support: the autotune-mode switch, the one-config choice, and the trainer's
throwaway compile pass leaving training exactly as it was (checked on CPU by running the pass
with real arithmetic, which is what it does minus the Triton launches)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3train.config import load_config
from k3train.runtime.distributed import init_distributed
from k3train.config.schema import KernelsConfig
from k3train.ops import backends as ops_backends
from k3train.ops import kernels, triton_compile
from k3train.trainer import state as state_mod
from k3train.trainer.state import TrainState


def test_autotune_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv("K3TRAIN_AUTOTUNE", "fastest")
    with pytest.raises(ValueError, match="K3TRAIN_AUTOTUNE='fastest' .*'full', 'fixed'"):
        kernels.apply(KernelsConfig())
    monkeypatch.setenv("K3TRAIN_AUTOTUNE", "fixed")
    kernels.apply(KernelsConfig())  # the override is read when the choices are resolved
    assert kernels.autotune_mode() == "fixed" and ops_backends.current().autotune == "fixed"


def test_smallest_config_least_tiles_then_stages_then_warps():
    def cfg(warps, stages, **kw):
        return SimpleNamespace(kwargs=kw, num_warps=warps, num_stages=stages)
    cands = [cfg(4, 2, BK=64, BV=64), cfg(1, 4, BK=32, BV=64), cfg(2, 3, BK=32, BV=64), cfg(8, 3, BK=32, BV=32)]
    assert triton_compile.smallest_config(cands) is cands[3]          # 32*32 tiles beat 32*64
    assert triton_compile.smallest_config(cands[:3]) is cands[2]      # equal tiles: fewer stages
    same = [cfg(8, 2, BK=64), cfg(4, 2, BK=64)]
    assert triton_compile.smallest_config(same) is same[1]            # then fewer warps
    # Non-tile kwargs (flags, None) do not count as tiles.
    flags = [cfg(4, 2, BK=64, USE_G=True), cfg(4, 2, BK=32, USE_G=None)]
    assert triton_compile.smallest_config(flags) is flags[1]


def _state(cfg):
    torch.manual_seed(0)
    return TrainState(cfg, init_distributed(device="cpu"), torch.device("cpu"))


@pytest.mark.slow
def test_compile_pass_leaves_training_unchanged(monkeypatch):
    """The trainer's compile pass (a forward/backward on a zero batch) must not move weights,
    optimizer or balancer state, gradients or routing: the next step equals a fresh state's."""
    cfg = load_config("configs/k3_tiny.yaml", ["train.seq_len=32", "train.micro_batch_size=2", "train.microbatches=2",
                                               "optim.name=muon"])
    batch = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    ref = _state(cfg)
    want = [ref.train_step(batch) for _ in range(2)]
    ran, evals = [], []
    monkeypatch.setattr(state_mod.kernels, "uses_triton", lambda device: True)
    monkeypatch.setattr(state_mod, "compile_ahead", lambda fn, label="": ran.append(fn()) or {"kernels": 0})
    evaluate = TrainState.evaluate
    monkeypatch.setattr(TrainState, "evaluate", lambda self, b: evals.append([x.shape for x in b]) or evaluate(self, b))
    got_state = _state(cfg)
    assert got_state.compile_kernels() == {"kernels": 0}
    assert len(ran) == 1 and torch.isfinite(ran[0])  # the pass really ran a forward/backward
    assert evals == [[(2, 33)]]  # and a validation forward of a validation batch's shape (issue 40)
    assert all(p.grad is None for p in got_state.params)
    got = [got_state.train_step(batch) for _ in range(2)]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-6)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    for (name, p), q in zip(got_state.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_compile_kernels_is_a_no_op_without_fla():
    cfg = load_config("configs/k3_tiny.yaml", ["train.seq_len=16", "train.micro_batch_size=2"])
    assert _state(cfg).compile_kernels() is None


def test_progress_reports_finished_compiles():
    """The progress line counts finished compiles among those submitted so far."""
    import io
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()
    out = io.StringIO()
    with ThreadPoolExecutor(2) as pool:
        mode = SimpleNamespace(raw_futures=[pool.submit(lambda: None), pool.submit(release.wait)])
        with triton_compile._progress(mode, time.perf_counter(), every=0.02, out=out):
            deadline = time.monotonic() + 10
            while "1/2 Triton compiles done" not in out.getvalue() and time.monotonic() < deadline:
                time.sleep(0.01)
            release.set()
    assert "1/2 Triton compiles done" in out.getvalue()


def test_progress_line_names_the_pending_kernels_then_the_pass():
    """Pending compiles are named by kernel with their candidate counts, most first; once all
    have finished, the line says the pass itself is what is still running (a bare
    "140/140 Triton compiles done" sat on screen for minutes)."""
    from concurrent.futures import Future

    def fut(done):
        f = Future()
        if done:
            f.set_result(None)
        return f

    futures = [fut(True), fut(False), fut(False), fut(False), fut(False), fut(True)]
    names = {futures[0]: "fla.a", futures[1]: "fla.chunk_kda_fwd", futures[2]: "fla.chunk_kda_fwd",
             futures[3]: "k3train.conv", futures[4]: "fla.x", futures[5]: "fla.b"}
    line = triton_compile.progress_line(futures, names, 42.4, show=2)
    assert line.startswith("[k3train]   2/6 Triton compiles done (42 s); waiting on ")
    assert "fla.chunk_kda_fwd (2 configs), " in line and line.endswith(" and 1 more kernels")
    for f in futures:
        if not f.done():
            f.set_result(None)
    assert triton_compile.progress_line(futures, names, 50.0).endswith(
        "6/6 Triton compiles done (50 s); still running the compile pass (torch.compile of fused ops, host code)")


def test_kernel_label_names_package_and_function():
    triton = pytest.importorskip("triton")

    @triton.jit
    def scale_kernel(x_ptr):
        pass

    assert triton_compile.kernel_label(scale_kernel) == f"{__name__.split('.')[0]}.scale_kernel"


def test_autotuning_is_announced_once_per_kernel(capsys):
    """Full autotuning names the kernel it is about to benchmark, once per kernel; fixed mode
    (one candidate) and single-candidate kernels stay quiet."""
    triton = pytest.importorskip("triton")

    @triton.autotune(configs=[triton.Config({"B": 16}), triton.Config({"B": 32}), triton.Config({"B": 64})],
                     key=["n"])
    @triton.jit
    def tuned_kernel(x_ptr, n, B: "triton.language.constexpr"):
        pass

    triton_compile._announced.discard(triton_compile.kernel_label(tuned_kernel))
    triton_compile.configure_autotune()
    with kernels.using(autotune="full"):
        triton_compile._state["compile_only"] = True  # inside compile-ahead: its own progress
        try:
            assert len(tuned_kernel.prune_configs({})) == 3
        finally:
            triton_compile._state["compile_only"] = False
        assert capsys.readouterr().err == ""
        assert len(tuned_kernel.prune_configs({})) == 3
        assert len(tuned_kernel.prune_configs({})) == 3
    with kernels.using(autotune="fixed"):
        assert len(tuned_kernel.prune_configs({})) == 1
    err = capsys.readouterr().err
    label = triton_compile.kernel_label(tuned_kernel)
    assert label.endswith(".tuned_kernel")
    assert err.count(f"[k3train] autotuning {label} (3 configs) ...") == 1


def test_launch_from_another_thread_compiles_in_the_pool(monkeypatch):
    """The autograd engine runs CUDA backward in its own thread, where Triton's async-compile
    mode (a ContextVar) is unset: the compile pass must submit those launches to its pool too,
    not compile them one by one in that thread, and leave the thread's state as it was."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    jit = pytest.importorskip("triton.runtime.jit")
    async_compile = pytest.importorskip("triton.runtime._async_compile")
    seen = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        seen.append((threading.current_thread().name, warmup, async_compile.active_mode.get()))

    monkeypatch.setattr(jit.JITFunction, "run", fake_run)
    after = []

    def backward_thread():
        jit.JITFunction.run(object(), grid=(1,), warmup=False)
        after.append(async_compile.active_mode.get())

    with ThreadPoolExecutor(1) as pool:
        mode = async_compile.AsyncCompileMode(pool)
        with triton_compile._launches_compile_only(mode, {}), mode:
            worker = threading.Thread(target=backward_thread, name="autograd")
            worker.start()
            worker.join()
            jit.JITFunction.run(object(), grid=(1,), warmup=False)
    assert seen == [("autograd", True, mode), ("MainThread", True, mode)]
    assert after == [None]


def test_full_autotuning_times_each_candidate_for_the_configured_window(monkeypatch):
    """kernels.autotune_bench_ms replaces Triton's 25 + 100 ms per candidate (most of a fresh
    run's step 1) with its window; 0 keeps Triton's benchmark, and a kernel's own is kept."""
    triton = pytest.importorskip("triton")
    from triton import testing

    configs = [triton.Config({"B": 16}), triton.Config({"B": 32})]

    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def windowed_kernel(x_ptr, n, B: "triton.language.constexpr"):
        pass

    own = lambda kernel_call, quantiles: 1.0  # noqa: E731
    @triton.autotune(configs=configs, key=["n"], do_bench=own)
    @triton.jit
    def own_bench_kernel(x_ptr, n, B: "triton.language.constexpr"):
        pass

    calls = []
    monkeypatch.setattr(testing, "do_bench", lambda fn, warmup, rep, quantiles: calls.append((warmup, rep, quantiles)))
    triton_compile.configure_autotune()
    with kernels.using(autotune="full", autotune_bench_ms=10.0):
        windowed_kernel.prune_configs({})
        own_bench_kernel.prune_configs({})
    windowed_kernel.do_bench(lambda: None, quantiles=(0.5,))
    assert calls == [(2.0, 10.0, (0.5,))]
    assert own_bench_kernel.do_bench is own
    windowed_kernel.__dict__.pop("do_bench")
    with kernels.using(autotune="full", autotune_bench_ms=0.0):
        windowed_kernel.prune_configs({})
    assert "do_bench" not in windowed_kernel.__dict__  # Triton's own benchmark, untouched
