"""train.offload_activations (k3train/model/offload.py): what recompute keeps, in host memory.

Reference: the same model (same seed, same recompute mode) without offload. The round trip is a
copy, so on CPU fp32 losses and every gradient must be bitwise equal (rtol = atol = 0). That the
hooks acted, and that each layer ran as two regions (mixer half, FFN half), is checked by
counting what they copied against the regions' inputs counted by hand from the layer pattern (a
hook that copies nothing, copies a shared block once per reader, or a layer left whole, fails
the counts).
"""
from __future__ import annotations

import pytest
import torch

from k3train.config import ConfigError, load_config
from k3train.model.model import K3Chunk, build_model, produced_blocks
from k3train.model.offload import ActivationOffload
from moe.balancing import Balancer
from k3train.runtime.distributed import init_distributed
from k3train.trainer.run_dir import save_config
from pipeline import PipelineEngine, PipelineLayout
from tests.helpers import tiny_cfg
from tests.multiproc import run_multiprocess

EXACT = dict(rtol=0, atol=0)
B, T, D = 2, 16, 32


def _cfg(mode: str, attnres: bool, offload: bool):
    # KDA, MLA, KDA, MLA; one dense layer then MoE; AttnRes blocks of 2 layers.
    return tiny_cfg("model.layer_pattern=KM", "model.dense_layers=1", f"model.attnres.enabled={attnres}",
                    "model.attnres.block_size=2", f"train.recompute={mode}",
                    f"train.offload_activations={offload}")


def _tiny_overrides(attnres: bool) -> list[str]:
    """``_cfg("full", attnres, True)`` as overrides (tiny_cfg's widths), for more to be added."""
    return [f"{k}={v}" for k, v in [
        ("model.hidden_size", 32), ("model.num_layers", 4), ("model.kda.num_heads", 2), ("model.kda.head_dim", 8),
        ("model.mla.num_heads", 2), ("model.mla.q_lora_rank", 16), ("model.mla.kv_lora_rank", 16),
        ("model.mla.qk_nope_head_dim", 8), ("model.mla.qk_rope_head_dim", 4), ("model.mla.v_head_dim", 8),
        ("model.ffn.intermediate_size", 32), ("moe.num_experts", 4), ("moe.latent_size", 16),
        ("moe.expert_ffn_size", 16), ("moe.shared_ffn_size", 16), ("train.plots", "false"),
        ("model.layer_pattern", "KM"), ("model.dense_layers", 1), ("model.attnres.enabled", attnres),
        ("model.attnres.block_size", 2), ("train.recompute", "full"), ("train.offload_activations", "true"),
        ("train.seq_len", T)]]


def _run(cfg):
    tokens = torch.randint(0, 257, (B, T + 1), generator=torch.Generator().manual_seed(3))
    model = build_model(cfg)
    if model.offload is not None:
        model.offload.min_bytes = 0   # the tiny model's tensors are far below the default 1 MiB
    loss = model(tokens[:, :-1], tokens[:, 1:])
    stats_after_forward = None if model.offload is None else dict(vars(model.offload.stats))
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}, stats_after_forward


@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_offload_is_bitwise_and_copies_what_recompute_keeps(world1, mode, attnres):
    _, ref_loss, ref_grads, _ = _run(_cfg(mode, attnres, False))
    model, loss, grads, fwd = _run(_cfg(mode, attnres, True))
    # Routing recorded once per forward, not again by either half's recompute.
    for layer in model.moe_layers():
        assert len(layer.routing.step) == 1
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g is not None, name
        torch.testing.assert_close(grads[name], g, **EXACT, msg=lambda s: f"{mode} {name}: {s}")
    stats = model.offload.stats
    act = B * T * D * 4   # one [B, T, D] fp32 activation
    # Under offload each layer is two regions: its mixer half (inputs: the partial sum and the
    # blocks) and its FFN half (inputs: the mixer half's output "mid" and the blocks).
    if mode == "full" and attnres:
        # L0: mixer (b0), FFN (mid0, b0) -> p0; L1: (p0, b0), (mid1, b0) -> closes b1;
        # L2: (b0, b1), (mid2, b0, b1) -> p2; L3: (p2, b0, b1), (mid3, b0, b1) -> closes b2;
        # the final mix (b0, b1, b2): 21 saves of 9 distinct tensors.
        assert (fwd["offloaded"], fwd["shared"], fwd["offloaded_bytes"]) == (9, 12, 9 * act)
        assert stats.restored == 21   # each region's recompute brought its inputs back once
    elif mode == "full":
        # Per layer its input and its mid, the embedding's included; nothing shared.
        assert (fwd["offloaded"], fwd["shared"], fwd["offloaded_bytes"]) == (8, 0, 8 * act)
        assert stats.restored == 8
    else:
        # selective also keeps the four cores' outputs and their saved tensors, and brings
        # back what the backward reads.
        inputs = 5 if attnres else 4
        assert fwd["offloaded"] > inputs + 4 and stats.restored > inputs + 4


def test_shared_tensor_is_copied_once_and_again_after_an_inplace_change():
    off = ActivationOffload(min_bytes=0)
    x = torch.arange(6.0).reshape(2, 3)
    a, b = off.pack(x), off.pack(x)
    assert a is b and off.stats.offloaded == 1 and off.stats.shared == 1
    assert a.host.data_ptr() != x.data_ptr()   # a copy, not the tensor itself
    x.add_(1)                                   # a new version: a new copy
    c = off.pack(x)
    assert c is not a and off.stats.offloaded == 2
    torch.testing.assert_close(off.unpack(a), torch.arange(6.0).reshape(2, 3), **EXACT)
    torch.testing.assert_close(off.unpack(c), torch.arange(6.0).reshape(2, 3) + 1, **EXACT)
    small = ActivationOffload(min_bytes=1 << 20)
    assert small.pack(x) is x and small.stats.kept == 1


def test_offload_needs_recompute_and_rules_out_cuda_graphs():
    with pytest.raises(ConfigError, match="train.offload_activations=true .* needs train.recompute=full or selective"):
        _cfg("none", True, True)
    cfg = tiny_cfg("train.recompute=full", "train.offload_activations=true", "data.document_mask=false")
    assert "train.offload_activations" in cfg.cuda_graph_blockers(device="cuda")
    assert "train.offload_activations" not in tiny_cfg(
        "train.recompute=full", "data.document_mask=false").cuda_graph_blockers(device="cuda")


def test_the_run_directory_records_offload(tmp_path):
    """The run's config.yaml (``save_config``, what ``k3train train`` writes) keeps the setting."""
    cfg = tiny_cfg("train.recompute=full", "train.offload_activations=true")
    save_config(cfg, tmp_path / "config.yaml")
    assert "offload_activations: true" in (tmp_path / "config.yaml").read_text()
    assert load_config(tmp_path / "config.yaml", []).train.offload_activations is True


def _pp_rank(rank, world_size):
    """P=2, V=2 on gloo ranks: full + offload against none, blocks crossing chunk ends; the
    engine's sent-output deallocation runs with the hooks in place."""
    init_distributed(pp=2)
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    layout = PipelineLayout(8, 2, 2)
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(layout.num_chunks))]
    gen = torch.Generator().manual_seed(5)
    mbs = [(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, 257, (2, 9), generator=gen) for _ in range(4))]
    results = {}
    for mode, offload in (("none", False), ("full", True)):
        cfg = tiny_cfg("model.layer_pattern=KM", "model.dense_layers=1", "model.num_layers=8",
                       "model.attnres.block_size=3", f"train.recompute={mode}", f"train.offload_activations={offload}")
        local = {c: K3Chunk(cfg, *ranges[c], first=c == 0, last=c == layout.num_chunks - 1)
                 for c in layout.chunks_of_rank(rank)}
        for chunk in local.values():
            if chunk.offload is not None:
                chunk.offload.min_bytes = 0
        engine = PipelineEngine(local_chunks=local, num_chunks=layout.num_chunks,
                                produced_blocks=produced_blocks(cfg, ranges), pp_group=group)
        loss = engine.train_step(mbs)
        moved = sum(ch.offload.stats.offloaded for ch in local.values() if ch.offload is not None)
        results[mode] = (loss, {(c, n): p.grad for c, ch in local.items() for n, p in ch.named_parameters()}, moved)
    loss, grads, moved = results["full"]
    assert moved > 0
    torch.testing.assert_close(loss, results["none"][0], **EXACT)
    for key, g in results["none"][1].items():
        torch.testing.assert_close(grads[key], g, **EXACT, msg=lambda s: f"rank {rank} {key}: {s}")


@pytest.mark.slow   # two gloo processes
def test_pipeline_p2_v2_with_offload_matches_none():
    run_multiprocess(_pp_rank, 2)


def _run_fp64(cfg):
    tokens = torch.randint(0, 257, (B, T + 1), generator=torch.Generator().manual_seed(3))
    model = build_model(cfg).double()
    model.offload.min_bytes = 0
    loss = model(tokens[:, :-1], tokens[:, 1:])
    host = dict(vars(model.offload.stats))
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}, host


@pytest.mark.parametrize("balancing", ["quantile", "aux_free"])
@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
def test_ffn_in_pieces_equals_the_whole_half(world1, attnres, balancing):
    """train.recompute_pieces=3 (pieces of 6, 5 and 5 of T = 16 tokens: the FFN halves and the
    mixer halves, KDA's with their conv halo and state, MLA's with the latent of their prefix)
    against 1, fp64, same weights: the loss and every gradient within 1e-12 (only the order of
    the weight gradients' sums over pieces differs), the same host bytes but for the states
    handed between KDA pieces and MLA's latents (a block's pieces are views of the block's one
    host copy, the halo's overlapping ones too), and the balancer's bias update from the step's
    records (each piece appends its own, in order) equal."""
    extra = [f"moe.balancing={balancing}"]
    cfg = load_config(None, [*_tiny_overrides(attnres), *extra, "train.recompute_pieces=3"])
    ref_cfg = load_config(None, [*_tiny_overrides(attnres), *extra])
    (m1, l1, g1, h1), (m3, l3, g3, h3) = _run_fp64(ref_cfg), _run_fp64(cfg)
    torch.testing.assert_close(l3, l1, rtol=1e-12, atol=1e-12)
    for name, g in g1.items():
        torch.testing.assert_close(g3[name], g, rtol=1e-12, atol=1e-12, msg=lambda s: f"{name}: {s}")
    m = cfg.model
    kda = m.layer_pattern.count("K") * m.num_layers // len(m.layer_pattern)
    state = B * m.kda.num_heads * m.kda.head_dim ** 2 * 8                  # [B, H, K, V] fp64
    latent = B * T * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * 8     # [B, T, R] fp64
    # 2 hand-overs per KDA layer; an MLA layer's latent, whose prefixes the pieces read
    assert h3["offloaded_bytes"] == h1["offloaded_bytes"] + kda * 2 * state + (m.num_layers - kda) * latent
    assert h3["shared"] > h1["shared"]   # the pieces: views of the whole inputs' copies
    for a, b in zip(m1.moe_layers(), m3.moe_layers()):
        assert len(a.routing.step) == 1 and len(b.routing.step) == 3
        bal = Balancer(balancing)
        bal.update(a)
        bal.update(b)
        torch.testing.assert_close(b.router.bias, a.router.bias, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("override,needs", [
    ("train.offload_activations=false", "train.offload_activations=true"),
    ("moe.balancing=aux_loss", "the balance loss is a statistic of the whole window"),
    ("moe.capacity_factor=1.5", "static dispatcher's capacity"),
    ("train.seq_len=2", "at most 2"),
])
def test_recompute_pieces_refuses_what_is_not_per_token(override, needs):
    with pytest.raises(ConfigError, match=needs):
        load_config(None, [*_tiny_overrides(True), "train.recompute_pieces=3", "moe.dispatcher=grouped_a2a",
                           override])


# Document starts (flat over B = 2 rows of T = 16; pieces [0, 6), [6, 11), [11, 16), halo 3):
# row 0 at a piece's first token (6) and inside the next piece's halo (9); row 1 inside the last
# piece (13), so its first document runs across both boundaries with its state handed over.
_DOCS = torch.tensor([0, 6, 9, 16, 29, 32])


@pytest.mark.parametrize("documents", [True, False], ids=["documents", "windows"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_mixer_halves_in_pieces_equal_the_whole_halves(world1, mode, documents):
    """The mixer halves in 3 pieces (KDA's each with the conv's halo and the state after the
    piece before; MLA's each with the latent of its prefix) against the whole halves, fp64, same
    weights and batch: loss and every gradient within 1e-12. With documents, one starts at a
    piece's first token, one inside a halo and one runs across both hand-overs: a halo that
    leaked across a start, a state handed to a document that starts at the piece, one not
    handed to a document that continues, or a query attending a key of another document or a
    later one, changes the loss. Under selective the pieces' kept outputs (KDA's output and
    state, MLA's attention) come back in the recompute."""
    over = [o for o in _tiny_overrides(True) if not o.startswith("train.recompute=")]
    over += [f"train.recompute={mode}", "moe.balancing=quantile", "model.layer_pattern=KKM", "model.num_layers=3"]
    segments = _DOCS if documents else None
    runs = {}
    for pieces in (1, 3):
        cfg = load_config(None, [*over, f"train.recompute_pieces={pieces}"])
        torch.manual_seed(0)
        model = build_model(cfg).double()
        model.offload.min_bytes = 0
        tokens = torch.randint(0, 257, (B, T + 1), generator=torch.Generator().manual_seed(3))
        loss = model(tokens[:, :-1], tokens[:, 1:], segments=segments)
        loss.backward()
        runs[pieces] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (l1, g1), (l3, g3) = runs[1], runs[3]
    torch.testing.assert_close(l3, l1, rtol=1e-12, atol=1e-12)
    for name, g in g1.items():
        assert g3[name] is not None, name
        torch.testing.assert_close(g3[name], g, rtol=1e-12, atol=1e-12, msg=lambda s: f"{name}: {s}")


def test_mixer_piece_boundaries():
    """The piece's own boundaries cut from the window's (_DOCS): the conv's [halo, piece] rows
    restart at every start inside them, the core's rows at every start inside the piece, and a
    row's first document continues unless a document starts at the piece's first token."""
    from k3train.model.mixer_pieces import mixer_piece
    p = mixer_piece(6, 11, halo=3, hand_over=True, cu_seqlens=_DOCS, batch=2, seq_len=16, device="cpu")
    assert p.halo == 3 and p.conv_cu.tolist() == [0, 3, 6, 8, 16] and p.core_cu.tolist() == [0, 3, 5, 10]
    assert p.first.tolist() == [0, 2] and p.last.tolist() == [1, 2] and p.continues.tolist() == [False, True]
    q = mixer_piece(11, 16, halo=3, hand_over=False, cu_seqlens=_DOCS, batch=2, seq_len=16, device="cpu")
    assert q.conv_cu.tolist() == [0, 1, 8, 13, 16] and q.core_cu.tolist() == [0, 5, 7, 10]
    assert q.continues.tolist() == [True, True] and q.last.tolist() == [0, 2]
    first = mixer_piece(0, 6, halo=3, hand_over=True, cu_seqlens=_DOCS, batch=2, seq_len=16, device="cpu")
    assert first.halo == 0 and first.continues.tolist() == [False, False]
