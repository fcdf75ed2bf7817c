"""The planner's peak against the CPU allocator's peak over one training step of a scaled-down
k3_mini (its KKKM pattern, a dense first layer then LatentMoE, AttnRes blocks of 4; small
widths, fp32, the torch forms), under each recompute mode, and under ``full`` with activation
offload.

Measured (the profiler's memory events, as in test_memory_plan_layouts.py): the peak over the
bytes live before the step, gradients already allocated by a first pass, routing records
cleared as the trainer does after a step. Besides what autograd saves, the backward holds two
terms no op saves (tracked by hand at the peak): the gradient accumulators of every AttnRes
block made below the layer in backward plus the stream's gradient
(``block_grads_bytes_per_token``), and every MoE layer's routing record of every microbatch the
step has run so far, kept until the step ends (``records_bytes_per_token``; under ``none`` the
scores and top-k ids in it are saved for backward too, ``records_shared_bytes_per_token``).
Before them the planner was 19% under with offload (4.66 MiB planned against 5.74 MiB
measured) and 14% under at ``full`` without (7.93 against 9.26 MiB); with them 1.000 at
``full``, 0.99 at ``none`` and ``selective``.

Offload: on CPU the host copies would sit in the same allocator as the activations, and
``unpack`` hands back the host copy itself; on CUDA the copies live in pinned host memory and
every unpack makes a new device copy (one per region, even of a block many regions share). The
test makes the CPU run behave like the GPU one: the offload hooks keep their copies as numpy
arrays (outside the torch allocator the profiler sees) and each unpack returns a fresh torch copy.
"""
from __future__ import annotations

import gc
import pytest
import torch

from k3train.model.model import build_model
from k3train.model.offload import _HostView
from k3train.profiling.activation_bytes import (block_grads_bytes_per_token, head_bytes_per_token,
                                               offload_bytes_per_token, records_bytes_per_token)
from k3train.profiling.memory_plan import plan_memory
from tests.helpers import allocator_peak, tiny_cfg


T = 128


def _cfg(offload: bool, mode: str = "full", microbatches: int = 1, balancing: str = "quantile", pieces: int = 1,
         seq: int = T):
    return tiny_cfg("model.layer_pattern=KKKM", "model.num_layers=16", "model.dense_layers=1",
                    "model.hidden_size=128", "model.kda.num_heads=2", "model.kda.head_dim=32",
                    "model.kda.chunk_size=16", "model.mla.num_heads=2", "model.mla.q_lora_rank=48",
                    "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8",
                    "model.mla.v_head_dim=16", "model.ffn.intermediate_size=256", "moe.num_experts=64",
                    "moe.topk=4", "moe.latent_size=64", "moe.expert_ffn_size=64", "moe.shared_ffn_size=128",
                    "model.attnres.enabled=true", "model.attnres.block_size=4", f"train.recompute={mode}",
                    f"train.offload_activations={offload}", "train.micro_batch_size=1", f"train.seq_len={seq}",
                    f"train.microbatches={microbatches}", f"moe.balancing={balancing}",
                    f"train.recompute_pieces={pieces}")


class _Host:
    """A saved tensor's copy outside the torch allocator (numpy), as pinned host memory is
    outside the CUDA allocator."""

    def __init__(self, t: torch.Tensor):
        self.array = t.detach().numpy().copy()


def _like_cuda(offload) -> None:
    offload.min_bytes = 0
    offload._to_host = _Host
    # Every unpack a new copy on the "device", as ``host.to(device)`` makes on CUDA.
    # A view of a copied tensor (a block's token piece, train.recompute_pieces) comes back as
    # that view of the copy.
    offload.unpack = lambda p: (torch.from_numpy(p.array).clone() if isinstance(p, _Host) else
                                torch.from_numpy(p.copy.array).as_strided(p.size, p.stride, p.offset).clone()
                                if isinstance(p, _HostView) else p)


def _measured_peak(cfg) -> int:
    """The allocator's peak over one step of ``train.microbatches`` forward+backward passes
    (gradients accumulating, routing records kept until the step ends, as the trainer does)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    if model.offload is not None:
        _like_cuda(model.offload)
    m, seq = cfg.train.microbatches, cfg.train.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (m, seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        for mb in tokens.split(1):
            model(mb[:, :-1], mb[:, 1:]).backward()
        for layer in model.moe_layers():
            layer.routing.clear()

    step()                      # allocates every gradient; the measured pass accumulates into them
    # Reference cycles hold some of a microbatch's tensors until the garbage collector runs; a
    # full collection first makes when it runs inside the step the same in every run (it
    # depended on the tests before: a full-suite run measured the records 23% low once).
    gc.collect()
    return allocator_peak(step)[0]


def _planned(cfg) -> float:
    (plan,) = plan_memory(cfg, ops="torch", act_bytes=4)
    # routing_last: each MoE record's last forward, made anew in the measured step (the old
    # one's frees are of blocks made before the profile, which the profiler cannot size).
    return plan.peak_activations[cfg.train.recompute] + plan.moe_buffers + plan.routing_last


@pytest.mark.parametrize("mode, offload", [("none", False), ("selective", False), ("full", False), ("full", True)],
                         ids=["none", "selective", "full", "full-offload"])
def test_device_peak_matches_the_allocator_within_10_percent(world1, mode, offload):
    cfg = _cfg(offload, mode)
    measured, predicted = _measured_peak(cfg), _planned(cfg)
    print(f"{mode} offload={offload}: planned {predicted / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB, "
          f"ratio {predicted / measured:.3f}")
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured, predicted / measured)
    if offload:
        # The planner before the two backward terms (the head, the larger half with its inputs
        # copied back, the MoE buffers) is more than 10% under: they are what closes the gap.
        (plan,) = plan_memory(cfg, ops="torch", act_bytes=4)
        half = max(offload_bytes_per_token(cfg, i, "full", "torch", T, 4)[1] for i in plan.layers)
        before = (head_bytes_per_token(cfg, "full", "torch", 4) + half) * T + plan.moe_buffers
        assert before < 0.9 * measured, (before, measured)


def test_full_recompute_peak_needs_both_backward_terms(world1):
    """Under ``full`` the planner matches the allocator to 0.1% at these shapes; either term
    left out puts it more than 3% under (the block gradients 3.4% of the peak here, the
    records 11%), so a 2% tolerance fails without either. (Asserted as that tolerance failing,
    not as a 3% bound: a full-suite run once measured the peak 0.7% low, 62 KB, which a 3%
    bound beside a 3.4% term does not absorb.)"""
    cfg = _cfg(False, "full")
    measured, predicted = _measured_peak(cfg), _planned(cfg)
    (plan,) = plan_memory(cfg, ops="torch", act_bytes=4)
    grads = max(block_grads_bytes_per_token(cfg, i, 4) for i in plan.layers) * T
    records = records_bytes_per_token(cfg, plan.layers, 4) * T
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)
    for left_out in (grads, records):
        assert predicted - left_out != pytest.approx(measured, rel=0.02), (left_out, predicted, measured)


@pytest.mark.parametrize("mode, balancing", [("none", "quantile"), ("full", "quantile"), ("full", "aux_free")])
def test_every_microbatch_adds_its_routing_records_until_the_step_ends(world1, mode, balancing):
    """Gradient accumulation over 2 microbatches: the step's peak (in the last backward) holds
    the first microbatch's records besides what one microbatch's step holds; the
    planner's step-over-microbatch difference is those records exactly, and the allocator's
    difference agrees within 10%: the ids and scores under quantile balancing (0.50 MiB here),
    the ids alone under aux_free (0.03 MiB; the whole routing would be 1.03 MiB)."""
    one, two = _cfg(False, mode, 1, balancing), _cfg(False, mode, 2, balancing)
    (plan,) = plan_memory(one, ops="torch", act_bytes=4)
    records = records_bytes_per_token(one, plan.layers, 4) * T
    planned = _planned(two) - _planned(one)
    assert planned == pytest.approx(records, rel=1e-9)
    # Each peak the smaller of two measurements: another thread's allocation inside the profile
    # only ever raises one (a run of the whole suite once measured one microbatch 110 KB high).
    measured = min(_measured_peak(two) for _ in range(2)) - min(_measured_peak(one) for _ in range(2))
    print(f"{mode} {balancing}: 2 microbatches over 1, planned +{planned / 2**20:.3f} MiB, measured +{measured / 2**20:.3f} MiB")
    # Under aux_free the ids alone are small beside the peak's jitter (8 KB seen, and 73 KB in
    # one full-suite run): within 25% of what one microbatch's scores would add (123 KB), which a
    # record keeping them (+480 KB) would exceed.
    scores = one.moe.num_experts * 4 * T * sum(1 for i in plan.layers if i >= one.model.dense_layers)
    tolerance = dict(rel=0.10) if balancing == "quantile" else dict(abs=0.25 * scores)
    assert planned == pytest.approx(measured, **tolerance), (planned, measured)
