"""Autotune picks (k3train/ops/autotune_picks.py): a run's choices written, read back and used
only where they still apply (same kernel, same tuning key, a candidate equal to the pick, the
same GPU model); the pruning hook then leaves one candidate, and a bad path is refused.

Reference: Triton's own tuning key (``Autotuner.run``: the ``key`` arguments' values, then each
tensor argument's dtype), written out here; the candidate lists are built by hand."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from k3train.config import load_config
from k3train.ops import autotune_picks as ap, kernels
from k3train.ops.triton_compile import configure_autotune

GPU = "NVIDIA H200"


def _kernel(x, N, BK):  # stands in for the Python function under @triton.jit
    pass


def _cfg(warps, stages, **kw):
    return SimpleNamespace(kwargs=kw, num_warps=warps, num_stages=stages, num_ctas=1, maxnreg=None)


def _tuner(cache, n=128):
    return SimpleNamespace(fn=SimpleNamespace(fn=_kernel), arg_names=["x", "N", "BK"], keys=["N"],
                           nargs={"x": torch.zeros(2, dtype=torch.bfloat16), "N": n}, cache=cache)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(ap, "_loaded", {"spec": None, "table": None, "source": None})
    monkeypatch.setattr(ap, "_device_name", lambda: GPU)


def test_written_picks_are_used_only_where_they_apply(tmp_path, fresh, monkeypatch):
    chosen = _cfg(8, 3, BK=64)
    ran = _tuner({(128, "torch.bfloat16"): chosen})
    assert ap.tuning_key(ran, {}) == (128, "torch.bfloat16")       # Triton's key, written out
    path = ap.write_picks(tmp_path / "picks.json", device_name=GPU, tuners=[ran])
    data = json.loads(path.read_text())
    assert data["device"] == GPU and data["format"] == ap.FORMAT
    assert data["kernels"] == {f"{__name__}._kernel": {"(128, 'torch.bfloat16')": {
        "kwargs": {"BK": 64}, "num_warps": 8, "num_stages": 3, "num_ctas": 1, "maxnreg": None}}}

    table = ap.table(str(path))
    candidates = [_cfg(4, 2, BK=32), _cfg(8, 3, BK=64), _cfg(8, 2, BK=64)]
    fresh_tuner = _tuner({})
    assert ap.pick(fresh_tuner, {}, candidates, table) is candidates[1]  # the equal candidate itself
    assert ap.pick(_tuner({}, n=256), {}, candidates, table) is None      # another shape: tune it
    assert ap.pick(fresh_tuner, {}, [candidates[0], candidates[2]], table) is None  # pick no longer offered
    other = SimpleNamespace(**{**vars(fresh_tuner), "fn": SimpleNamespace(fn=test_written_picks_are_used_only_where_they_apply)})
    assert ap.pick(other, {}, candidates, table) is None                 # another kernel
    assert ap.source(str(path)) == str(path)
    # Tuned on another GPU model: not used here.
    monkeypatch.setattr(ap, "_loaded", {"spec": None, "table": None, "source": None})
    monkeypatch.setattr(ap, "_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert ap.table(str(path)) == {} and ap.source(str(path)) is None
    assert ap.gpu_slug(GPU) == "nvidia_h200" and ap.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def test_writing_merges_with_the_file_for_the_same_gpu(tmp_path, fresh):
    path = tmp_path / "picks.json"
    ap.write_picks(path, device_name=GPU, tuners=[_tuner({(128, "torch.bfloat16"): _cfg(4, 2, BK=32)})])
    ap.write_picks(path, device_name=GPU, tuners=[_tuner({(256, "torch.bfloat16"): _cfg(8, 3, BK=64)})])
    keys = json.loads(path.read_text())["kernels"][f"{__name__}._kernel"]
    assert sorted(keys) == ["(128, 'torch.bfloat16')", "(256, 'torch.bfloat16')"]
    assert ap.write_picks(tmp_path / "none.json", device_name=GPU, tuners=[]) is None
    assert not (tmp_path / "none.json").exists()


def test_the_pruning_hook_keeps_only_the_pick(tmp_path, fresh):
    triton = pytest.importorskip("triton")

    @triton.jit
    def scale(x, N, BK: triton.language.constexpr):
        pass

    configs = [triton.Config({"BK": 32}, num_warps=4, num_stages=2),
               triton.Config({"BK": 64}, num_warps=8, num_stages=3)]
    tuner = triton.autotune(configs=configs, key=["N"])(scale)
    tuner.nargs = {"x": torch.zeros(2, dtype=torch.bfloat16), "N": 128}
    done = _tuner({(128, "torch.bfloat16"): configs[1]})
    done.fn = tuner  # same kernel: the autotuner's own function
    path = ap.write_picks(tmp_path / "picks.json", device_name=GPU, tuners=[done])
    configure_autotune()
    with kernels.using(autotune="full", autotune_picks=str(path)):
        assert tuner.prune_configs({}) == [configs[1]]
    with kernels.using(autotune="full", autotune_picks="none"):
        assert tuner.prune_configs({}) == configs
    with kernels.using(autotune="fixed", autotune_picks=str(path)):
        assert tuner.prune_configs({}) == [configs[0]]  # fixed: the smallest tiles, picks unused


def test_a_bad_picks_path_is_one_clear_line(tmp_path):
    cfg = load_config("configs/k3_tiny.yaml", [f"kernels.autotune_picks={tmp_path / 'missing.json'}"])
    with pytest.raises(kernels.KernelChoiceError, match="no such file; allowed: auto, none, or the path"):
        kernels.apply(cfg)
    (tmp_path / "junk.json").write_text("{}")
    cfg = load_config("configs/k3_tiny.yaml", [f"kernels.autotune_picks={tmp_path / 'junk.json'}"])
    with pytest.raises(kernels.KernelChoiceError, match="is not an autotune picks file"):
        kernels.apply(cfg)


@pytest.mark.parametrize("path", sorted(ap.SHIPPED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_each_shipped_picks_file_is_found_for_its_gpu_and_names_live_kernels(path):
    """A shipped file is what ``auto`` reads on its GPU model, and each of our own kernels it names
    still exists under that name (a renamed kernel would silently be tuned again on every run)."""
    import importlib

    data = ap.read_picks(path)
    assert ap.resolve_source("auto", data["device"]) == path
    fields = {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}
    for kernel, by_key in data["kernels"].items():
        assert by_key and all(set(cfg) == fields for cfg in by_key.values()), kernel
        module, _, name = kernel.rpartition(".")
        if module.split(".")[0] in ("k3train", "optim", "moe", "pipeline"):
            fn = ap.python_function(getattr(importlib.import_module(module), name))
            assert f"{fn.__module__}.{fn.__name__}" == kernel
