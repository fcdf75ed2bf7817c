"""The one device resolver (k3train.runtime.device) names the setting the user typed."""
import pytest
import torch

from k3train.errors import UsageError
from k3train.runtime.device import resolve_device


def test_cuda_without_a_gpu_names_the_flag_that_asked_for_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"^--device=cuda but no CUDA device is visible; use --device=cpu or auto$"):
        resolve_device("cuda", setting="--device")
    with pytest.raises(UsageError, match=r"^train\.device=cuda"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
    # building on the meta device for a CUDA config (model-info on a laptop) does not check
    assert resolve_device("cuda", check_available=False) == torch.device("cuda")
    assert resolve_device(torch.device("meta")) == torch.device("meta")
