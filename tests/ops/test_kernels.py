"""The kernel backend registry: config fields -> one resolved backend per op family, handed to
moe and optim; the documented environment overrides; the run directory's record; and the rule
that no other module reads a behaviour-steering environment variable."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from k3train.ops import kernels
from k3train.config import ConfigError, load_config
from k3train.config.schema import KernelsConfig
from k3train.errors import K3TrainError
from moe import backends as moe_backends
from optim import backends as optim_backends

FAMILIES = ("kda", "attnres", "short_conv", "router_topk", "moe_permute", "muon_momentum", "ns_gemm")


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    for var in kernels.ENV_OVERRIDES:
        monkeypatch.delenv(var, raising=False)
    kernels.apply(KernelsConfig(), pipeline_gpu=False)
    yield
    kernels.apply(KernelsConfig(), pipeline_gpu=False)


def _installed(monkeypatch, **have):
    """Pretend only the backends in ``have`` are installed, and resolve the defaults again (the
    choices are frozen when resolved: a later install check does not change them)."""
    monkeypatch.setattr(kernels, "installed", lambda b: b == "torch" or have.get(b, False))
    kernels.apply(KernelsConfig(), pipeline_gpu=False)


def test_every_family_is_torch_off_cuda(monkeypatch):
    _installed(monkeypatch, fla=True, k3train=True)
    assert set(kernels.FAMILIES) == set(FAMILIES)
    assert all(kernels.backend(f, "cpu") == "torch" for f in FAMILIES)
    assert not kernels.compile_enabled("cpu") and not kernels.uses_triton("cpu")


def test_auto_picks_the_first_installed_backend_on_cuda(monkeypatch):
    _installed(monkeypatch, fla=True, k3train=True)
    got = {f: kernels.backend(f, "cuda") for f in FAMILIES}
    assert got == {"kda": "fla", "attnres": "fla", "short_conv": "k3train", "router_topk": "k3train",
                   "moe_permute": "k3train", "muon_momentum": "k3train", "ns_gemm": "k3train"}
    _installed(monkeypatch, k3train=True)  # no fla: fla's families fall back, ours stay
    assert kernels.backend("kda", "cuda") == "torch" and kernels.backend("short_conv", "cuda") == "k3train"
    _installed(monkeypatch)  # neither Triton nor fla
    assert all(kernels.backend(f, "cuda") == "torch" for f in FAMILIES)


def test_config_fields_choose_and_reach_moe_and_optim(monkeypatch):
    _installed(monkeypatch, fla=True, k3train=True)
    kernels.apply(KernelsConfig(short_conv="fla", router_topk="torch", ns_gemm="torch", compile=False))
    assert kernels.backend("short_conv", "cuda") == "fla" and kernels.backend("router_topk", "cuda") == "torch"
    assert moe_backends.current() == moe_backends.Backends(router_topk="torch", moe_permute="k3train",
                                                           compile=False)
    assert optim_backends.current() == optim_backends.Backends(momentum="k3train", ns_gemm="torch")
    assert not kernels.compile_enabled("cuda")
    kernels.apply(KernelsConfig(backend="torch"))
    assert all(kernels.backend(f, "cuda") == "torch" for f in FAMILIES)
    assert moe_backends.current() == moe_backends.Backends(router_topk="torch", moe_permute="torch", compile=False)
    assert optim_backends.current() == optim_backends.Backends(momentum="torch", ns_gemm="torch")
    assert not kernels.uses_triton("cuda")


def test_compile_auto_is_on_for_pipeline_gpu_runs_too():
    """compile-ahead compiles every rank's pieces before step 1, so auto no longer turns compile
    off under pipeline parallelism; false still does."""
    assert kernels.compile_enabled("cuda")
    kernels.apply(load_config("configs/k3_tiny.yaml", ["parallel.pp=2", "train.device=cuda"]))
    assert kernels.compile_enabled("cuda") and kernels.resolve(
        load_config("configs/k3_tiny.yaml", ["parallel.pp=2", "train.device=cuda"])).pipeline_gpu
    kernels.apply(load_config("configs/k3_tiny.yaml", ["parallel.pp=2", "train.device=cuda", "kernels.compile=false"]))
    assert not kernels.compile_enabled("cuda") and moe_backends.current().compile is False
    kernels.apply(load_config("configs/k3_tiny.yaml", ["parallel.pp=2", "train.device=cpu"]))
    assert kernels.compile_enabled("cuda")


def test_a_backend_that_is_not_installed_is_refused_in_one_line(monkeypatch):
    _installed(monkeypatch, k3train=True)
    with pytest.raises(K3TrainError, match=r"^kernels.kda=fla but the gpu extra .* is not installed here; .*"
                                           r"allowed: auto, fla, torch\)$"):
        kernels.apply(KernelsConfig(kda="fla"))
    assert kernels.backend("kda", "cuda") == "torch"  # the refused settings did not stick
    with pytest.raises(ConfigError, match="kernels.short_conv"):
        load_config("configs/k3_tiny.yaml", ["kernels.short_conv=cudnn"])


def test_environment_overrides_one_field_each(monkeypatch):
    _installed(monkeypatch, fla=True, k3train=True)
    monkeypatch.setenv("K3TRAIN_KERNELS", "torch")
    monkeypatch.setenv("K3TRAIN_COMPILE", "0")
    monkeypatch.setenv("K3TRAIN_AUTOTUNE", "fixed")
    assert kernels.backend("kda", "cuda") == "fla"  # read when resolved, not per call
    kernels.apply(KernelsConfig())
    assert kernels.backend("kda", "cuda") == "torch" and not kernels.compile_enabled("cuda")
    assert kernels.autotune_mode() == "fixed"
    rec = kernels.resolved("cuda")
    assert rec["env_overrides"] == {"K3TRAIN_KERNELS": "torch", "K3TRAIN_COMPILE": "0", "K3TRAIN_AUTOTUNE": "fixed"}
    monkeypatch.setenv("K3TRAIN_COMPILE", "maybe")
    with pytest.raises(K3TrainError, match=r"K3TRAIN_COMPILE='maybe' \(overrides kernels.compile\)"):
        kernels.apply(KernelsConfig())
    assert kernels.autotune_mode() == "fixed"  # the refused resolve left the choices in force
    monkeypatch.delenv("K3TRAIN_COMPILE")


def test_using_restores_the_settings(monkeypatch):
    _installed(monkeypatch, fla=True, k3train=True)
    with kernels.using(short_conv="torch", ns_gemm="torch"):
        assert kernels.backend("short_conv", "cuda") == "torch" and optim_backends.current().ns_gemm == "torch"
    assert kernels.backend("short_conv", "cuda") == "k3train" and optim_backends.current().ns_gemm == "k3train"


def test_resolved_record_round_trips(tmp_path):
    kernels.apply(KernelsConfig(autotune="fixed", router_topk="torch"))
    rec = kernels.write_resolved(tmp_path, "cpu")
    assert json.loads((tmp_path / "kernels.json").read_text()) == rec
    assert rec["families"] == {f: "torch" for f in FAMILIES} and rec["autotune"] == "fixed"
    assert rec["requested"]["router_topk"] == "torch" and rec["compile"] is False


# Environment variables that are not a config field's override, and why they may stay.
_NOT_STEERING = {
    "K3TRAIN_FAULTS": "fault injection for the reliability tests (k3train/trainer/faults.py)",
    "K3TRAIN_STACKS_AFTER": "a debugging stack dump of a hung run (k3train/cli.py)",
}


def test_no_behaviour_steering_variable_is_read_outside_the_registry():
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in [p for pkg in ("k3train", "moe", "optim", "pipeline") for p in (root / pkg).rglob("*.py")]:
        if path.name == "kernels.py" and path.parent.name == "k3train":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for var in re.findall(r"environ(?:\.get)?\(?\[?\s*[\"'](K3TRAIN_\w+)", line):
                if var not in _NOT_STEERING:
                    offenders.append(f"{path.relative_to(root)}:{n}: {var}")
    assert not offenders, offenders


def test_each_backend_verifies_shapes_and_dtypes_beside_it():
    """The verifiers sit beside the kernels, so the ops ask one question; the limits here are the
    kernels' own (topk: 2-D scores of fp32/bf16/fp16, up to 1024 columns, 0 < k <= 32, a
    contiguous [E] bias; row passes: those dtypes; short conv: [B, T, C] with a [C, W] weight)."""
    from k3train.ops.short_conv import TritonShortConv
    from moe.permute_fused import TritonRows
    from moe.topk import TritonTopk

    if not TritonTopk.is_available():
        pytest.skip("Triton is not importable here")
    s = torch.zeros(4, 64)
    assert TritonTopk.verify(s, 16, None) and TritonTopk.verify(s.bfloat16(), 32, torch.zeros(64))
    assert not TritonTopk.verify(s, 33, None)                         # k above MAX_K
    assert not TritonTopk.verify(torch.zeros(4, 1025), 4, None)       # columns above MAX_COLUMNS
    assert not TritonTopk.verify(s.double(), 4, None)                 # dtype
    assert not TritonTopk.verify(s[None], 4, None)                    # not [N, E]
    assert not TritonTopk.verify(s, 4, torch.zeros(63))               # bias not [E]
    assert not TritonTopk.verify(s, 4, torch.zeros(128)[::2])         # bias not contiguous
    assert TritonRows.verify(torch.zeros(3, 8, dtype=torch.bfloat16))
    assert not TritonRows.verify(torch.zeros(3, 8, dtype=torch.float64))
    assert TritonShortConv.verify(torch.zeros(2, 5, 8), torch.zeros(8, 4))
    assert not TritonShortConv.verify(torch.zeros(2, 5, 8), torch.zeros(6, 4))
    assert not TritonShortConv.verify(torch.zeros(5, 8), torch.zeros(8, 4))


def test_choices_are_frozen_and_the_environment_is_not_read_per_call(monkeypatch):
    _installed(monkeypatch, fla=True, k3train=True)
    choices = kernels.current()
    with pytest.raises(dataclasses.FrozenInstanceError):
        choices.compile_cuda = False
    monkeypatch.setenv("K3TRAIN_KERNELS", "torch")   # after resolving: nothing changes
    assert kernels.current() is choices and kernels.backend("short_conv", "cuda") == "k3train"
    assert moe_backends.current().router_topk == "k3train" and optim_backends.current().ns_gemm == "k3train"
