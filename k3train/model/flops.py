"""Training FLOPs per token and model FLOPs utilisation (MFU) for a run config.

Counted for one token of a training step (forward + backward = 3 x forward, 2 FLOPs per
multiply-add), for the whole model (tensor-parallel size 1), sequence length ``T``:

    F = 6 * N_mm                                       projections (dense, MoE, head)
      + sum_MLA 3 * 2 * H * (d_qk + d_v) * (T + 1)/2   causal softmax attention
      + sum_KDA 6 * H * (C * (3K + 2V) + 3 * K * V)    chunked delta rule (chunk C)
      + sum_sublayers 12 * S_i * d                     AttnRes depth attention (S_i sources)

``N_mm`` are the *activated* matmul parameters: every weight a token multiplies once (router
over all experts, top-k routed experts, shared expert, latent projections, all attention
projections, the output head; KDA's depthwise conv weights also cost one multiply-add per
token each). The embedding is a lookup and costs nothing. Element-wise work (norms,
activations, gates, decays, softmax) is left out, as in the usual 6N accounting.

MLA: the query at position t (1-based) scores t keys (t*d_qk multiply-adds per head) and mixes
t values (t*d_v); the mean of t over a causal sequence is (T + 1)/2.

KDA (per head, per token, forward multiply-adds; see ``k3train/ops/kda/chunk.py``):
    intra-chunk  A_qk and A_kk scores             2 * C * K
                 UT transform applied to [v, k]   C * (V + K)
                 A_qk @ delta                     C * V
    inter-chunk  W @ S, q @ S, k^T @ delta        3 * K * V
The C x C products are counted dense, as GPU kernels execute them. ``docs/flops.md`` has the
derivation and a worked example.
"""
from __future__ import annotations

from k3train.config.schema import RunConfig
from k3train.config.layer_pattern import expand_layer_pattern

__all__ = ["matmul_params", "flops_breakdown", "flops_per_token", "mfu"]


def _kda_params(cfg: RunConfig) -> int:
    d, k = cfg.model.hidden_size, cfg.model.kda
    width = k.num_heads * k.head_dim
    return (4 * d * width            # q, k, v, output gate projections
            + 3 * width * k.conv_size  # depthwise short convs on q, k, v
            + (d * k.head_dim + k.head_dim * width if k.gate == "channel" else d * k.num_heads)  # forget gate
            + d * k.num_heads          # beta
            + width * d)               # o_proj


def _mla_params(cfg: RunConfig) -> int:
    d, a = cfg.model.hidden_size, cfg.model.mla
    H = a.num_heads
    return (d * a.q_lora_rank + a.q_lora_rank * H * (a.qk_nope_head_dim + a.qk_rope_head_dim)
            + d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim)
            + d * H * a.v_head_dim    # sigmoid output gate
            + H * a.v_head_dim * d)   # o_proj


def _moe_params(cfg: RunConfig) -> int:
    d, m = cfg.model.hidden_size, cfg.moe
    return (d * m.num_experts                          # router scores every expert
            + 2 * d * m.latent_size                     # latent down and up
            + m.topk * 3 * m.latent_size * m.expert_ffn_size
            + 3 * d * m.num_shared_experts * m.shared_ffn_size)


def matmul_params(cfg: RunConfig) -> dict[str, int]:
    """Activated matmul parameters per token by component (``kda``, ``mla``, ``dense_ffn``,
    ``moe``, ``head``) and their ``total``."""
    m = cfg.model
    kinds = expand_layer_pattern(m.layer_pattern, m.num_layers)
    out = {
        "kda": kinds.count("K") * _kda_params(cfg),
        "mla": kinds.count("M") * _mla_params(cfg),
        "dense_ffn": min(m.dense_layers, m.num_layers) * 3 * m.hidden_size * m.ffn.intermediate_size,
        "moe": max(m.num_layers - m.dense_layers, 0) * _moe_params(cfg),
        "head": m.hidden_size * m.vocab_size,
    }
    out["total"] = sum(out.values())
    return out


def _attnres_sources(num_layers: int, block_size: int) -> list[int]:
    """Sources S_i seen by each DepthAttention in order (mixer, ffn per layer, then the final one);
    mirrors ``K3Layer.forward``: completed blocks (embedding included) plus the partial sum."""
    out = []
    for i in range(num_layers):
        done = 1 + i // block_size
        out.append(done + (i % block_size != 0))  # the first layer of a block has no partial yet
        out.append(done + 1)
    out.append(1 + num_layers // block_size + (num_layers % block_size != 0))
    return out


def flops_breakdown(cfg: RunConfig, seq_len: int | None = None) -> dict[str, float]:
    """Training FLOPs per token by term (module docstring) plus ``total``.

    ``seq_len`` defaults to ``train.seq_len`` (MLA's cost grows with it; the rest does not).
    """
    m = cfg.model
    T = cfg.train.seq_len if seq_len is None else seq_len
    kinds = expand_layer_pattern(m.layer_pattern, m.num_layers)
    a, k = m.mla, m.kda
    mla_fwd = 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * (T + 1) / 2
    K = V = k.head_dim
    kda_fwd = 2 * k.num_heads * (k.chunk_size * (3 * K + 2 * V) + 3 * K * V)
    out = {
        "matmul": 6.0 * matmul_params(cfg)["total"],
        "mla_attention": kinds.count("M") * 3 * mla_fwd,
        "kda_recurrence": kinds.count("K") * 3.0 * kda_fwd,
        "attnres": (12.0 * m.hidden_size * sum(_attnres_sources(m.num_layers, m.attnres.block_size))
                    if m.attnres.enabled else 0.0),
    }
    out["total"] = sum(out.values())
    return out


def flops_per_token(cfg: RunConfig, seq_len: int | None = None) -> float:
    """Training (forward + backward) FLOPs per token."""
    return flops_breakdown(cfg, seq_len)["total"]


# Datasheet dense bf16 peak FLOP/s of one GPU (no sparsity), by a part of the name torch reports
# (``torch.cuda.get_device_name``); the first match wins, so a more specific name comes first.
# MFU is counted against these, as Megatron, torchtitan and the papers count it.
DATASHEET_BF16_PEAK: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
    ("A100", 312e12), ("A800", 312e12), ("B200", 2250e12), ("B100", 1750e12),
)


def datasheet_peak_flops(device_name: str | None) -> float | None:
    """One GPU's datasheet dense bf16 peak FLOP/s, or None for a CPU (``None``) or an unknown
    model, for which no MFU is reported."""
    if not device_name:
        return None
    return next((peak for part, peak in DATASHEET_BF16_PEAK if part in device_name), None)


def mfu(tokens_per_s: float, cfg: RunConfig, peak_flops: float, num_devices: int = 1,
        seq_len: int | None = None) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the devices' peak.

    ``tokens_per_s`` is the throughput of all ``num_devices`` together (the trainer's logged
    ``tokens_per_s`` is global); ``peak_flops`` is one device's dense peak in FLOP/s for the
    precision used (e.g. 989e12 for H200 bf16).
    """
    if peak_flops <= 0 or num_devices < 1:
        raise ValueError(f"need peak_flops > 0 and num_devices >= 1, got {peak_flops}, {num_devices}")
    return tokens_per_s * flops_per_token(cfg, seq_len) / (peak_flops * num_devices)
