"""benchmarks/memory_timeline.py: the profiler's memory timeline read at its peak (what
bench_memory_plan --timeline reports on a GPU), checked on CPU against known allocations."""
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
from benchmarks.memory_timeline import format_peak, phase_of, profile_peak  # noqa: E402
from k3train.config import load_config  # noqa: E402
from k3train.runtime.distributed import init_distributed  # noqa: E402
from k3train.trainer.state import TrainState  # noqa: E402
from tests.helpers import SMALL  # noqa: E402

N = 4_000_000  # floats: 16 MB


def make_two_big_tensors():
    a = torch.ones(N)
    b = a * 2          # a and b alive together: the peak, inside this function
    del a
    return float(b[0])


def test_the_peak_is_the_known_allocations_inside_the_named_function():
    peak = profile_peak(make_two_big_tensors, torch.device("cpu"))
    assert abs(peak["peak_bytes"] - 2 * N * 4) < 4096, peak
    assert any("make_two_big_tensors" in name for name in peak["at"]), peak["at"]
    assert peak["phase"] == "other" and 0.0 <= peak["fraction"] <= 1.0
    assert "make_two_big_tensors" in format_peak(peak)


def test_phase_of_reads_the_enclosing_frames():
    assert phase_of(["aten::mul", "optim/muon.py(80): step", "Optimizer.step#Muon.step"]) == "optimizer"
    assert phase_of(["aten::mm", "autograd::engine::evaluate_function: MmBackward0"]) == "backward"
    # a forward recomputed inside a backward is the backward's
    assert phase_of(["moe/experts.py(178): forward", "torch/autograd/__init__.py(255): backward"]) == "backward"
    assert phase_of(["aten::add", "nn.Module: RMSNorm_0"]) == "forward"
    assert phase_of(["aten::add"]) == "other"


@pytest.mark.slow   # the profiler's memory analysis of a whole step
def test_a_training_step_shows_its_parameters_and_optimizer_state(world1):
    # The small model (tests/helpers.py SMALL) at two layers (KDA dense, MLA MoE): the
    # profiler's cost is per recorded op and allocation, and the categories' bytes are exact at
    # any width or depth.
    cfg = load_config("configs/k3_tiny.yaml", [*SMALL, "model.num_layers=2", "model.layer_pattern=KM",
                                               "train.device=cpu", "train.recompute=none", "train.microbatches=2",
                                               "train.micro_batch_size=2", "train.seq_len=32"])
    state = TrainState(cfg, init_distributed(device="cpu"), torch.device("cpu"))
    batch = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    state.train_step(batch)                         # the optimizer state exists from here on
    peak = profile_peak(lambda: state.train_step(batch), torch.device("cpu"))
    param_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters())
    assert peak["categories"]["PARAMETER"] == param_bytes
    assert peak["peak_bytes"] >= param_bytes + peak["categories"].get("OPTIMIZER_STATE", 0)
    assert peak["phase"] in ("forward", "backward", "optimizer")
