"""The memory planner (k3train/profiling/memory_plan.py) against measured and counted memory.

Activations: the planner's op-by-op formulas for the pure-torch forms against the bytes autograd
actually keeps on CPU (distinct saved storages, parameters excluded: tests/model/
test_recompute_memory.py), for each layer type (KDA, MLA, dense, MoE, with and without AttnRes)
under each recompute mode: within 15%. Parameters: against the model's own count. Optimizer
state: AdamW 8 and Muon 4 bytes per parameter, ZeRO-1 dividing by dp (experts by dp/ep).
Context parallelism (2 gloo ranks, fp32): the KDA fold's kept states under both partitions,
to the byte, and head-tail's MLA exchange on its heaviest rank, within 15%.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.config import load_config
from k3train.model.model import build_model
from k3train.ops.context_parallel import kda_cp
from k3train.ops.kda import kda
from k3train.profiling.memory_plan import cp_extra_bytes, kda_fold_state_bytes, plan_memory
from k3train.runtime.distributed import init_distributed, parallel_context
from tests.helpers import SavedBytes, saved_bytes, tiny_cfg
from tests.multiproc import run_multiprocess

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
    per MLA layer, the key side of every other token the gathered latent is expanded for and
    the mask's bias SDPA's fused kernel keeps, and per KDA layer the fold's fp32
    states, fla's seed and the wider values and correction copy per local token; counted here
    from the config's widths (ops fused, bf16 activations)."""
    base = ["train.seq_len=256", "train.micro_batch_size=2", "train.device=cuda"]
    cfg = load_config("configs/k3_tiny.yaml", base)
    assert cfg.data.masks_documents   # the default: the CP attention masks within documents
    short = load_config("configs/k3_tiny.yaml", [*base, "train.seq_len=64"])
    (four,), (one,) = plan_memory(cfg, cp=4), plan_memory(short, cp=1)
    for mode in ("none", "selective", "full"):
        assert four.peak_activations[mode] == one.peak_activations[mode]
    m, a = cfg.model, 2
    n_mla = m.layer_pattern.count("M") * m.num_layers // len(m.layer_pattern)
    n_kda = m.num_layers - n_mla
    # the key side of the 256 - 64 tokens the last rank expands beyond its own (fused ops): the
    # latent (the compiled kv_norm's input is its view), the norm's fp32 rstd, kv_up's input,
    # the attention's k and v
    a_ = m.mla
    per_mla = 2 * (256 - 64) * ((a_.kv_lora_rank + a_.qk_rope_head_dim) * a + 4 + a_.kv_lora_rank * a
                                + a_.num_heads * (a_.qk_nope_head_dim + a_.qk_rope_head_dim + a_.v_head_dim) * a)
    # the document mask's bias, [B, 64 queries, 256 keys] in bf16
    mask = 2 * 64 * 256 * a
    # [E, M]: K x (V + K), S_r: K x V, fp32, per head and window (V = K = head_dim); fla keeps
    # the [0, I] seed, K x (V + K) fp32; per local token (2 x 64) the K extra columns of v
    # (bf16) and the correction's q~ (fp32: the correction runs outside autocast), one K per
    # head each
    H, K = m.kda.num_heads, m.kda.head_dim
    states = 2 * H * (K * 2 * K + K * K) * 4
    seed = 2 * H * K * 2 * K * 4
    per_kda = states + seed + 2 * 64 * H * K * (a + 4)
    assert four.cp_extra["none"] == four.cp_extra["selective"] == n_mla * (per_mla + mask) + n_kda * per_kda
    assert four.cp_extra["full"] == max(per_mla + mask, per_kda)
    assert one.cp_extra["none"] == 0 and four.total("none", False) == one.total("none", False) + four.cp_extra["none"]
    # head-tail: two pieces per rank, so two folds' states and seeds per KDA layer; rank 0's
    # second piece ends the sequence (its keys are every key) and the gathered latent is
    # reordered by an int64 index of the sequence's length
    ht = load_config("configs/k3_tiny.yaml", [*base, "parallel.cp_partition=head_tail"])
    (four_ht,) = plan_memory(ht, cp=4)
    per_kda_ht = 2 * (states + seed) + 2 * 64 * H * K * (a + 4)
    assert four_ht.cp_extra["none"] == n_mla * (per_mla + mask + 256 * 8) + n_kda * per_kda_ht
    # without document masking each piece attends its own prefix: rank 0's pieces 0 and 7 of
    # 32 tokens, [32, 32] and [32, 256] masks broadcast over the batch
    plain = load_config("configs/k3_tiny.yaml", [*base, "parallel.cp_partition=head_tail", "data.document_mask=false"])
    (four_plain,) = plan_memory(plain, cp=4)
    assert four_plain.cp_extra["none"] == n_mla * (per_mla + (32 * 32 + 32 * 256) * a + 256 * 8) + n_kda * per_kda_ht
    assert four_ht.peak_activations == four.peak_activations
    with pytest.raises(ValueError, match="divisible by 8"):
        plan_memory(ht.model_copy(update={"train": ht.train.model_copy(update={"seq_len": 260})}), cp=4)
    with pytest.raises(ValueError, match="divisible"):
        plan_memory(cfg, cp=3)


# --------------------------------------------------------------------------- CP partitions, measured

CP_B, CP_T = 2, 128   # local tokens per rank; head-tail pieces of 64 fill the torch KDA's chunks


def _cp_cfg(pattern: str, partition: str, *extra: str, local: int = CP_T):
    return tiny_cfg(f"model.layer_pattern={pattern}", "model.num_layers=1", "parallel.cp=2",
                    f"parallel.cp_partition={partition}", f"train.seq_len={2 * local}",
                    f"train.micro_batch_size={CP_B}", *extra)


def _fold_kept_bytes(rank: int, group, partition: str, local: int, doc_starts=()) -> int:
    """Bytes ``kda_cp`` keeps for backward outside its kernel calls (whose own saved tensors are
    the local tokens' activations, collected apart), fp32, ``local`` tokens on this rank;
    ``doc_starts`` as kda_cp's (document masking on when not empty)."""
    H, K = 2, 8
    gen = torch.Generator().manual_seed(rank)
    q, k = (F.normalize(torch.randn(CP_B, local, H, K, generator=gen), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(CP_B, local, H, K, generator=gen, requires_grad=True)
    g = (-torch.rand(CP_B, local, H, K, generator=gen)).requires_grad_()
    beta = torch.rand(CP_B, local, H, generator=gen, requires_grad=True)
    inner, outer = SavedBytes(), SavedBytes((q, k, v, g, beta))
    # Every packed tensor stays referenced until the count: a storage freed with a discarded
    # branch of the graph (the document path replaces the stacked M) could otherwise hand its
    # address to a later one, which the count (keyed by address) would then misfile.
    alive = []

    def hold(saved):
        return lambda t: alive.append(t) or saved.pack(t)

    def kernel(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(hold(inner), lambda t: t):
            return kda(*args, **kwargs)

    with torch.autograd.graph.saved_tensors_hooks(hold(outer), lambda t: t):
        o = kda_cp(q, k, v, g, beta, group=group, kernel=kernel, partition=partition, doc_starts=doc_starts)
    o.sum().backward()
    return sum(n for ptr, n in outer.storages.items() if ptr not in inner.storages)


def _cp_fold_body(rank, world, partition):
    group = parallel_context(init_distributed(cp=2)).cp_group
    # What the fold keeps outside the kernel: its states (independent of the length) and the
    # per-token correction's q~ (the kernel's output, linear in it): the states are the part
    # that does not grow, 2 x kept(T) - kept(2T).
    measured = 2 * _fold_kept_bytes(rank, group, partition, CP_T) - _fold_kept_bytes(rank, group, partition, 2 * CP_T)
    planned = kda_fold_state_bytes(_cp_cfg("K", partition), 2)
    assert planned == measured, (rank, planned, measured)


def _cp_fold_documents_body(rank, world, partition):
    group = parallel_context(init_distributed(cp=2)).cp_group
    # KimiDeltaAttention folds row by row under document masking; a start in a row's first
    # piece (doc_starts) or none (a document longer than the rank's share)
    def states(starts):
        return 2 * _fold_kept_bytes(rank, group, partition, CP_T, starts) \
            - _fold_kept_bytes(rank, group, partition, 2 * CP_T, starts)

    with_start, without = states((5,)), states(())
    cfg = _cp_cfg("K", partition, "data.document_mask=true")
    assert cfg.data.masks_documents
    planned = kda_fold_state_bytes(cfg, 2)
    L, H, K = (2 if partition == "head_tail" else 1), 2, 8
    # a row with a start stacks M afresh: S and M, K x (V + K) per piece; one without keeps the
    # kernel's [E, M] storage beside S, K x (2V + K): the bound the plan counts
    assert with_start == L * CP_B * H * K * (K + K) * 4, (rank, with_start)
    assert without == planned == 3 * with_start // 2, (rank, without, planned)


@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
def test_cp_kda_fold_plan_matches_the_states_kept_per_partition(partition):
    """KDA's CP fold (``kda_cp`` called on each of 2 gloo ranks, fp32): the bytes kept for its
    backward beside the kernel's own equal ``kda_fold_state_bytes``, to the byte. Head-tail keeps one
    ``[E, M]`` and one folded state per piece, twice the contiguous bytes: planned as contiguous it
    would be half the measured bytes."""
    run_multiprocess(_cp_fold_body, 2, partition)


@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
def test_cp_kda_fold_plan_under_document_masking_is_the_rows_without_a_start(partition):
    """With document masking ``kda_cp`` runs per row (as KimiDeltaAttention calls it): a row with
    a document start in the rank's pieces stacks each piece's transition M into a fresh
    ``[K, K]`` tensor and keeps ``K (V + K)`` per piece, to the byte; a row without one keeps
    the kernel's ``K (V + K)``-wide end state beside S, ``K (2V + K)``, 3/2 of it. The plan is
    that bound (a document longer than the rank's share), to the byte."""
    run_multiprocess(_cp_fold_documents_body, 2, partition)


def _layer_saved(mixer, x, params) -> int:
    saved = SavedBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        y = mixer(x)
    y.sum().backward()
    return saved.total


def _cp_layer_extra(rank, kind: str, partition: str, local: int):
    """(cfg, bytes) on 2 gloo ranks: what the first layer (``kind``) keeps under CP beyond the same
    tokens' activations without it, on the heaviest rank."""
    group = parallel_context(init_distributed(cp=2)).cp_group
    cfg = _cp_cfg(kind, partition, local=local)
    torch.manual_seed(0)
    model = build_model(cfg)
    mixer = model.layers[0].mixer
    x = torch.randn(CP_B, local, cfg.model.hidden_size, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    alone = _layer_saved(mixer, x, model.parameters())   # the same tokens' activations, no exchange
    model.use_context_parallel(group, None, partition)
    extra = torch.tensor(float(_layer_saved(mixer, x, model.parameters()) - alone))
    dist.all_reduce(extra, op=dist.ReduceOp.MAX, group=group)   # the heaviest rank's
    return cfg, extra.item()


def _cp_mla_body(rank, world, partition):
    cfg, extra = _cp_layer_extra(rank, "M", partition, local=32)
    planned = cp_extra_bytes(cfg, [0], 4, 2, ops="torch")   # CPU: SDPA's math path
    assert planned == pytest.approx(extra, rel=0.15), (rank, planned, extra)


@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
def test_cp_mla_plan_matches_the_heaviest_rank(partition):
    """MLA (the layer on each of 2 gloo ranks, fp32): what the layer keeps beyond the same
    tokens' activations without CP, on the heaviest rank (contiguous: the last; head-tail:
    rank 0, whose second piece ends the sequence), against ``cp_extra_bytes`` within 15%: the
    key side of every other token (latent, kv_norm, kv_up's input, k and v) and the math path's
    probabilities over the extra keys. Contiguous measures 39,168 bytes, planned 40,192; the
    formula that counted the gathered latent and k, v of every key planned 30,720 (0.78)."""
    run_multiprocess(_cp_mla_body, 2, partition)


def _cp_kda_body(rank, world, partition):
    # head-tail pieces of 128: two of the torch kernel's chunks, as without CP
    cfg, extra = _cp_layer_extra(rank, "K", partition, local=2 * CP_T)
    planned = cp_extra_bytes(cfg, [0], 4, 2, ops="torch")
    assert planned == pytest.approx(extra, rel=0.10), (rank, planned, extra)
    # the fold's states alone (the plan before the per-token terms) are a few percent of it
    assert kda_fold_state_bytes(cfg, 2) < 0.05 * extra


@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
def test_cp_kda_layer_plan_matches_the_heaviest_rank(partition):
    """The KDA layer (each of 2 gloo ranks, fp32, 256 local tokens): what it keeps under CP beyond
    the same tokens' activations without CP, against ``cp_extra_bytes`` within 10%: the fold's
    states, and per local token the kernel's value-wide tensors run K columns wider (values
    ``[v, 0]``: the solve's right-hand side and solution and each chunk's delta, and the
    per-chunk states) and the output correction's copy of ``q~``. Measured 140,544 bytes
    (contiguous) and 130,688 (head-tail) against 138,240 and 141,312 planned; the fold's states
    alone, the plan before, were 3,072 and 6,144. Not planned: the short convs' halos (3 tokens
    per piece, 2,304 / 5,760 bytes here) and, under head-tail, the torch kernel's per-chunk
    GEMM copies that its shorter pieces lay out differently (16 KiB fewer here)."""
    run_multiprocess(_cp_kda_body, 2, partition)
