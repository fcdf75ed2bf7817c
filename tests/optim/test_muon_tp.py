"""Muon at ``parallel.tp=2`` steps every parameter exactly as at ``tp=1`` (fp64, gloo ranks).

Newton-Schulz of a TP shard is not the shard of Newton-Schulz of the whole matrix, so each
TP-sharded Muon matrix whose blocks straddle the shards is orthogonalised whole
(``optim.muon.tp_shard``). The reference is the TP=1 model of the same seed (megatron-core's CPU
initialisation: TP=2 holds its slices) given the same whole gradients; the TP=2 ranks get their
slices of them. Two steps (the second with momentum), then every parameter gathered whole must
equal the reference's to fp64 rounding (``rtol = atol = 1e-12``): the gathered Newton-Schulz
input is the TP=1 input bit for bit, so only the batch a matrix rides in differs.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from k3train.config import load_config
from k3train.model.model import build_model
from k3train.runtime.distributed import init_distributed
from k3train.trainer.optimizer import build_k3_optimizer, k3_param_rules, muon_ns_flops_per_rank
from optim import GradGroups, build_param_table
import optim.muon as muon_mod
from optim.muon import tp_gather_bytes, tp_shard
from tests.multiproc import run_multiprocess

# The tiny model of tests.helpers.tiny_cfg with 4 heads (2 per TP rank) and both mixers.
_MODEL = ["model.hidden_size=32", "model.num_layers=2", "model.layer_pattern=KM", "model.kda.num_heads=4",
          "model.kda.head_dim=8", "model.mla.num_heads=4", "model.mla.q_lora_rank=16",
          "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4",
          "model.mla.v_head_dim=8", "model.ffn.intermediate_size=32", "model.dense_layers=1",
          "moe.num_experts=4", "moe.latent_size=16", "moe.expert_ffn_size=16", "moe.shared_ffn_size=16",
          "optim.name=muon", "optim.lr=0.02", "optim.weight_decay=0.1"]
_VARIANTS = {
    "replicated": ["optim.muon_distributed=false"],
    "distributed": ["optim.muon_distributed=true"],
    "zero1": ["optim.zero1=true"],
    "whole-matrix": ["optim.muon_distributed=false", "optim.muon_per_head=false"],
}


def _whole_shape(p: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if tp > 1 and getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= tp
    return tuple(shape)


def _gather(p: torch.Tensor, tp: int) -> torch.Tensor:
    """``p`` whole: its TP slices concatenated along ``partition_dim``."""
    t = p.detach()
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=p.partition_dim)


def _set_grads(model, tp: int, step: int) -> None:
    """Whole gradients drawn per (parameter, step) from a fixed seed; each rank its TP slice."""
    for i, (_name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator().manual_seed(1000 * step + i)
        g = torch.randn(_whole_shape(p, tp), generator=gen, dtype=torch.float64)
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            g = g.chunk(tp, dim=p.partition_dim)[ps.get_tensor_model_parallel_rank()]
        p.grad = g.contiguous()


def _stepped(tp: int, overrides: list[str]):
    """Every parameter, whole, after two Muon steps on the fixed gradients at ``tp``; for each
    Muon matrix whether it is gathered over TP; the bytes each DP rank (this rank's DP group)
    received in Muon's TP all-gathers per step; ``tp_gather_bytes``' count for the replicated
    step; and ``muon_ns_flops_per_rank`` at DP = 1."""
    init_distributed(tp=tp)
    cfg = load_config(None, [*_MODEL, *overrides])
    torch.manual_seed(3)
    model = build_model(cfg).double()
    # DP peers (tp=2 at a world of 4) hold identical gradients: reduced, they stay the same.
    dp = ps.get_data_parallel_group() if dist.get_world_size() // tp > 1 else None
    groups = GradGroups(dp=dp, expert_dp=ps.get_expert_data_parallel_group() if dp else None,
                        tp=ps.get_tensor_model_parallel_group())
    experts = [p for layer in model.moe_layers() for p in layer.experts.parameters()]
    opt, _ = build_k3_optimizer(model, cfg.optim, groups=groups, expert_params=experts)
    received, real = [0], muon_mod._all_gather

    def counting(out, inp, group=None, **kw):
        received[0] += (out.numel() - inp.numel()) * out.element_size()
        return real(out, inp, group=group, **kw)

    muon_mod._all_gather = counting
    try:
        for step in range(2):
            _set_grads(model, tp, step)
            opt.step()
            opt.zero_grad()
    finally:
        muon_mod._all_gather = real
    heads = _heads(model, cfg)
    params = dict(model.named_parameters())
    gathered = {name: tp_shard(params[name], h, groups.tp) is not None for name, h in heads.items()}
    expected = tp_gather_bytes([(params[name], h) for name, h in heads.items()], tp, element_size=8)
    # The Newton-Schulz FLOPs a rank runs at DP = 1, gathered matrices counted whole.
    (flops,) = muon_ns_flops_per_rank(model, cfg.optim, dp=1, tp=tp)
    per_dp = [received[0] // 2]
    if dp is not None:
        per_dp = [None] * dist.get_world_size(dp)
        dist.all_gather_object(per_dp, received[0] // 2, group=dp)
    return ({name: _gather(p, tp) for name, p in params.items()}, gathered, per_dp, expected, flops)


def _heads(model, cfg) -> dict[str, int | None]:
    """The Muon entries' ``heads`` by name."""
    table = build_param_table(model.named_parameters(), k3_param_rules(model, cfg.optim.muon_per_head))
    return {e.name: e.heads for e in table if e.optimizer == "muon"}


def _tp2_steps_as_tp1(rank: int, world: int, variants: list[str]) -> None:
    for variant in variants:
        got, gathered, received, expected, flops = _stepped(2, _VARIANTS[variant])
        ref, _, _, _, ref_flops = _stepped(1, _VARIANTS[variant])
        # Gathered matrices cost a TP rank TP=1's FLOPs; local per-head blocks half of them.
        per_head = "optim.muon_per_head=false" not in _VARIANTS[variant]
        assert (flops < ref_flops) if per_head else (flops == ref_flops), (variant, flops, ref_flops)
        assert got.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-12,
                                       msg=lambda m, name=name: f"{variant}: {name}: {m}")
        # Both kinds are exercised: whole-matrix gathers (FFN, o_proj, gates) and, per head,
        # the row-sharded q/k/v blocks that stay local.
        assert any(gathered.values()), variant
        assert any(n.endswith("ffn.down_proj.inner.weight") and g for n, g in gathered.items()), gathered
        if "optim.muon_per_head=false" not in _VARIANTS[variant]:
            assert not any(g for n, g in gathered.items() if ".q_proj." in n or ".kv_up." in n), gathered
        else:
            assert all(g for n, g in gathered.items() if ".q_proj." in n), gathered
        # The TP all-gathers' bytes per step: (tp - 1) slices received per gathered shard this
        # rank orthogonalises; all of them in the replicated step, each one on one DP rank with
        # owners (distributed Muon, ZeRO-1), so their sum over DP is the replicated step's.
        assert expected > 0
        if variant == "replicated":
            assert received == [expected] * len(received), (variant, received, expected)
        else:
            assert sum(received) == expected and min(received) >= 0, (variant, received, expected)


def test_muon_tp2_steps_as_tp1():
    run_multiprocess(_tp2_steps_as_tp1, 2, ["replicated", "zero1", "whole-matrix"])


@pytest.mark.slow  # 4 gloo ranks
def test_muon_dp2_tp2_steps_as_tp1():
    """DP = 2 x TP = 2: distributed Muon (owners over DP, each owner slot gathering over its TP
    group) and ZeRO-1 (each matrix owned by one DP rank, its TP peers owning its other slices)."""
    run_multiprocess(_tp2_steps_as_tp1, 4, ["distributed", "zero1", "replicated"])
