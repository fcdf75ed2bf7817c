"""The memory planner (k3train/profiling/memory_plan.py) against measured and counted memory.

Activations: the planner's op-by-op formulas for the pure-torch forms against the bytes autograd
actually keeps on CPU (distinct saved storages, parameters excluded: tests/model/
test_recompute_memory.py), for each layer type (KDA, MLA, dense, MoE, with and without AttnRes)
under each recompute mode: within 15%. Parameters: against the model's own count. Optimizer
state: AdamW 8 and Muon 4 bytes per parameter, ZeRO-1 dividing by dp (experts by dp/ep).
"""
from __future__ import annotations

import pytest

from k3train.config import load_config
from k3train.profiling.memory_plan import plan_memory
from tests.helpers import tiny_cfg
from tests.helpers import saved_bytes

B, T = 2, 32


def _cfg(pattern, dense, attnres, mode, *extra):
    return tiny_cfg(f"model.layer_pattern={pattern}", "model.num_layers=4", f"model.dense_layers={dense}",
                     "model.hidden_size=64", "model.kda.head_dim=16", "model.mla.q_lora_rank=32",
                     "model.ffn.intermediate_size=128", "moe.latent_size=32", "moe.expert_ffn_size=32",
                     "moe.shared_ffn_size=64", "moe.topk=2", "model.kda.chunk_size=16",
                     f"model.attnres.enabled={attnres}", "model.attnres.block_size=2",
                     f"train.recompute={mode}", f"train.micro_batch_size={B}", f"train.seq_len={T}", *extra)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
@pytest.mark.parametrize("pattern, dense", [("K", 4), ("M", 4), ("K", 0), ("M", 0)],
                         ids=["kda-dense", "mla-dense", "kda-moe", "mla-moe"])
def test_activation_formulas_match_saved_bytes_on_cpu(world1, pattern, dense, attnres, mode):
    cfg = _cfg(pattern, dense, attnres, mode)
    measured = saved_bytes(cfg, batch=B, seq=T)
    predicted = plan_memory(cfg, ops="torch", act_bytes=4)[0].activations[mode]
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured, predicted / measured)


def _state_bytes(obj) -> int:
    """Bytes of every tensor in an optimizer state dict (scalar step counters excluded)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if obj.dim() else 0
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_parameters_and_optimizer_state_match_a_real_step(world1, optim):
    """Reference: the real model's parameters and the state the real K3 optimizer holds after
    one step (AdamW moments, Muon momentum); ZeRO-1 at dp=4 keeps a quarter of it."""
    import torch

    from k3train.model.model import build_model
    from k3train.trainer.optimizer import build_k3_optimizer

    cfg = _cfg("K", 1, True, "none", f"optim.name={optim}")
    model = build_model(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt, _ = build_k3_optimizer(model, cfg.optim)
    opt.step()
    plan = plan_memory(cfg, ops="torch", act_bytes=4, dp=4)[0]
    n_params = sum(p.numel() for p in model.parameters())
    assert plan.params == plan.grads == 4 * n_params
    assert plan.optimizer == _state_bytes(opt.state_dict())
    assert plan.optimizer_zero1 == pytest.approx(plan.optimizer / 4)


def test_pipeline_ranks_split_the_model_and_hold_the_warmup_depth(world1):
    """pp=2, vpp=2, ep=2 over dp=2: the ranks' parameters add up to the model's with the routed
    experts halved; rank 0 runs Megatron's interleaved warmup, (P-1)*2 + (V-1)*P = 4 forwards,
    so it holds 5 chunk forwards at its peak, of at most 4 microbatches."""
    from k3train.model.info import model_info

    cfg = _cfg("K", 1, True, "full", "parallel.pp=2", "parallel.vpp=2", "parallel.ep=2",
               "train.microbatches=4")
    plans = plan_memory(cfg, ops="torch", act_bytes=4, dp=2)
    counts, _ = model_info(cfg)
    want = counts["total"] - counts["routed_experts"] // 2
    assert sum(q.params for q in plans) == 4 * want
    assert sorted(i for q in plans for i in q.layers) == list(range(4))
    assert plans[0].in_flight == 4 and plans[1].in_flight <= plans[0].in_flight
    assert plans[0].attnres_cache > 0


def test_model_info_prints_the_memory_plan_and_refuses_a_bad_dp(capsys):
    from k3train.cli import main

    assert main(["model-info", "--config", "configs/k3_tiny.yaml", "parallel.pp=2", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "per-rank memory (GiB), tp=1 pp=2 vpp=1 ep=1 dp=2" in out and "act selective" in out
    assert main(["model-info", "--config", "configs/k3_tiny.yaml", "parallel.ep=2", "--dp", "3"]) == 2
    assert capsys.readouterr().err.strip() == ("k3train: error: --dp must be a positive multiple of "
                                              "parallel.ep=2 (expert parallelism runs inside data parallelism), got 3")


def test_context_parallel_plan_is_the_shorter_sequence_plus_the_exchanges(world1):
    """cp ranks each keep seq_len/cp tokens' activations (the plan of the shorter sequence) plus,
    per MLA layer, the gathered latent and the keys/values expanded from it for the whole
    sequence, and per KDA layer the fold's fp32 states; counted here from the config's widths."""
    base = ["train.seq_len=256", "train.micro_batch_size=2", "train.device=cuda"]
    cfg = load_config("configs/k3_tiny.yaml", base)
    short = load_config("configs/k3_tiny.yaml", [*base, "train.seq_len=64"])
    (four,), (one,) = plan_memory(cfg, cp=4), plan_memory(short, cp=1)
    for mode in ("none", "selective", "full"):
        assert four.peak_activations[mode] == one.peak_activations[mode]
    m, a = cfg.model, 2
    n_mla = m.layer_pattern.count("M") * m.num_layers // len(m.layer_pattern)
    n_kda = m.num_layers - n_mla
    per_mla = 2 * 256 * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * a \
        + 2 * 256 * m.mla.num_heads * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim + m.mla.v_head_dim) * a
    # [E, M]: K x (V + K), S_r: K x V, fp32, per head and window (V = K = head_dim)
    per_kda = 2 * m.kda.num_heads * (m.kda.head_dim * 2 * m.kda.head_dim + m.kda.head_dim ** 2) * 4
    assert four.cp_extra["none"] == four.cp_extra["selective"] == n_mla * per_mla + n_kda * per_kda
    assert four.cp_extra["full"] == per_mla
    assert one.cp_extra["none"] == 0 and four.total("none", False) == one.total("none", False) + four.cp_extra["none"]
    with pytest.raises(ValueError, match="divisible"):
        plan_memory(cfg, cp=3)
