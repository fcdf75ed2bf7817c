"""prepare_cuda_env: eager CUDA module loading exactly for pipeline-parallel GPU runs."""
from __future__ import annotations

import os

import pytest

from k3train.config import load_config
from k3train.runtime.cuda_env import prepare_cuda_env


@pytest.mark.parametrize("pp, device, want", [(2, "cuda", "EAGER"), (2, "auto", "EAGER"), (1, "cuda", None),
                                              (2, "cpu", None)])
def test_eager_loading_only_for_gpu_pipelines(monkeypatch, pp, device, want):
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    prepare_cuda_env(load_config("configs/k3_tiny.yaml", [f"parallel.pp={pp}", f"train.device={device}"]))
    assert os.environ.get("CUDA_MODULE_LOADING") == want


def test_user_setting_is_kept(monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    prepare_cuda_env(load_config("configs/k3_tiny.yaml", ["parallel.pp=2", "train.device=cuda"]))
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"
