"""Our state-dict names <-> the Hugging Face (Kimi Linear / DeepSeek-V3 style) tensor names.

Every HF tensor is ``(name, tensor)`` with the layout a HF ``nn.Linear`` consumer expects:
``[out, in]`` weights, depthwise convs as ``nn.Conv1d`` weights ``[C, 1, W]``, one tensor per
expert. The table (and what has no HF counterpart) is docs/hf_format.md; the functions here are
its single implementation, so export and import cannot drift apart.

Layer kinds come from the config (``K`` = KDA, ``M`` = gated MLA): both live under
``self_attn`` in HF, as Kimi Linear does, and differ only in which tensors exist.
"""
from __future__ import annotations

import torch

from k3train.errors import CheckpointError

# (our suffix inside ``layers.N.``, HF suffix inside ``model.layers.N.``), tensors that move as-is.
_COMMON = [
    ("mixer_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("mixer_res.query", "attn_res.mixer_query"),  # Block AttnRes: no HF counterpart
    ("ffn_res.query", "attn_res.ffn_query"),
]
_KDA = [
    ("mixer.q_proj.inner.weight", "self_attn.q_proj.weight"),
    ("mixer.k_proj.inner.weight", "self_attn.k_proj.weight"),
    ("mixer.v_proj.inner.weight", "self_attn.v_proj.weight"),
    ("mixer.A_log", "self_attn.A_log"),
    ("mixer.f_down.weight", "self_attn.f_a_proj.weight"),
    ("mixer.f_up.inner.weight", "self_attn.f_b_proj.weight"),
    ("mixer.b_proj.inner.weight", "self_attn.b_proj.weight"),
    ("mixer.g_proj.inner.weight", "self_attn.g_proj.weight"),  # full rank: Kimi Linear has g_a/g_b
    ("mixer.o_norm_weight", "self_attn.o_norm.weight"),        # per head [H, K]: Kimi Linear [K]
    ("mixer.o_proj.inner.weight", "self_attn.o_proj.weight"),
]
# Depthwise short convs: ours [C, W], nn.Conv1d's [C, 1, W] (same tap order: last = current token).
_KDA_CONV = [("mixer.q_conv", "self_attn.q_conv1d.weight"), ("mixer.k_conv", "self_attn.k_conv1d.weight"),
             ("mixer.v_conv", "self_attn.v_conv1d.weight")]
# dt_bias: ours [H, K], fla/Kimi Linear flat [H*K].
_KDA_FLAT = [("mixer.dt_bias", "self_attn.dt_bias")]
_MLA = [
    ("mixer.q_down.weight", "self_attn.q_a_proj.weight"),
    ("mixer.q_norm.weight", "self_attn.q_a_layernorm.weight"),
    ("mixer.q_up.inner.weight", "self_attn.q_b_proj.weight"),
    ("mixer.kv_down.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("mixer.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
    ("mixer.kv_up.inner.weight", "self_attn.kv_b_proj.weight"),
    ("mixer.gate_proj.inner.weight", "self_attn.g_proj.weight"),  # output gate: not in Kimi Linear
    ("mixer.o_proj.inner.weight", "self_attn.o_proj.weight"),
]
_DENSE = [(f"ffn.{p}.inner.weight", f"mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
_MOE = [
    ("ffn.router.weight", "mlp.gate.weight"),
    ("ffn.router.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.down.weight", "mlp.latent_down_proj.weight"),  # latent MoE: no HF counterpart
    ("ffn.norm.weight", "mlp.latent_norm.weight"),
    ("ffn.up.weight", "mlp.latent_up_proj.weight"),
] + [(f"ffn.shared.{p}.weight", f"mlp.shared_experts.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
# Grouped experts ``[E, in, out]`` used as ``x @ w[e]`` -> per expert nn.Linear ``[out, in]``.
_EXPERTS = [("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")]
_TOP = [("embed.weight", "model.embed_tokens.weight"), ("final_norm.weight", "model.norm.weight"),
        ("final_res.query", "model.final_attn_res.query"), ("head.weight", "lm_head.weight")]


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def to_hf(state: dict, kinds: str, moe_layers: set[int], tied: bool) -> dict[str, torch.Tensor]:
    """Our full state dict (one process) -> {HF name: tensor}. ``kinds``: one letter per layer.

    Non-tensor entries (megatron's ``_extra_state``) are dropped; a tied head is written once,
    as the embedding. Raises KeyError naming the first of our tensors that has no HF name.
    """
    out: dict[str, torch.Tensor] = {}
    used = set()

    def put(ours: str, hf: str, value: torch.Tensor) -> None:
        used.add(ours)
        out[hf] = value.contiguous()

    for ours, hf in _TOP:
        if ours in state and not (tied and ours == "head.weight"):
            put(ours, hf, state[ours])
    used.add("head.weight")
    for i, kind in enumerate(kinds):
        pre, hpre = f"layers.{i}.", f"model.layers.{i}."
        pairs = _COMMON + (_KDA if kind == "K" else _MLA) + (_MOE if i in moe_layers else _DENSE)
        for ours, hf in pairs:
            if pre + ours in state:
                put(pre + ours, hpre + hf, state[pre + ours])
        if kind == "K":
            for ours, hf in _KDA_CONV:
                put(pre + ours, hpre + hf, state[pre + ours].unsqueeze(1))
            for ours, hf in _KDA_FLAT:
                put(pre + ours, hpre + hf, state[pre + ours].reshape(-1))
        if i in moe_layers:
            for ours, proj in _EXPERTS:
                w = state[pre + "ffn.experts." + ours]
                used.add(pre + "ffn.experts." + ours)
                for e in range(w.shape[0]):
                    out[expert_name(i, e, proj)] = w[e].t().contiguous()
    left = [k for k, v in state.items() if isinstance(v, torch.Tensor) and k not in used]
    if left:
        raise KeyError(f"no Hugging Face name for {left[0]} (and {len(left) - 1} more)")
    return out


def from_hf(hf: dict[str, torch.Tensor], kinds: str, moe_layers: set[int], tied: bool,
            shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """{HF name: tensor} -> our state dict; ``shapes`` holds each of our tensors' expected shape
    (from the model the config builds). Raises CheckpointError naming a missing HF tensor, a
    tensor whose shape differs from the config's."""
    out: dict[str, torch.Tensor] = {}

    def take(hf_name: str) -> torch.Tensor:
        if hf_name not in hf:
            raise CheckpointError(f"the Hugging Face checkpoint lacks tensor {hf_name}")
        return hf[hf_name]

    def put(ours: str, value: torch.Tensor, hf_name: str) -> None:
        want = tuple(shapes[ours])
        if tuple(value.shape) != want:
            raise CheckpointError(f"tensor {hf_name} has shape {list(value.shape)} but the config.json model "
                             f"needs {list(want)} for it")
        out[ours] = value

    for ours, name in _TOP:
        if ours in shapes and not (tied and ours == "head.weight"):
            put(ours, take(name), name)
    for i, kind in enumerate(kinds):
        pre, hpre = f"layers.{i}.", f"model.layers.{i}."
        pairs = _COMMON + (_KDA if kind == "K" else _MLA) + (_MOE if i in moe_layers else _DENSE)
        for ours, name in pairs:
            if pre + ours in shapes:
                put(pre + ours, take(hpre + name), hpre + name)
        if kind == "K":
            for ours, name in _KDA_CONV:
                w = take(hpre + name)
                put(pre + ours, w.squeeze(1) if w.dim() == 3 else w, hpre + name)
            for ours, name in _KDA_FLAT:
                w = take(hpre + name)
                shape = shapes[pre + ours]
                put(pre + ours, w.reshape(shape) if w.numel() == shape.numel() else w, hpre + name)
        if i in moe_layers:
            for ours, proj in _EXPERTS:
                full = shapes[pre + "ffn.experts." + ours]
                ws = []
                for e in range(full[0]):
                    name = expert_name(i, e, proj)
                    w = take(name)
                    if tuple(w.shape) != (full[2], full[1]):
                        raise CheckpointError(f"tensor {name} has shape {list(w.shape)} but the config.json model "
                                         f"needs {[full[2], full[1]]} for it")
                    ws.append(w.t())
                out[pre + "ffn.experts." + ours] = torch.stack(ws).contiguous()
    if tied:
        out["head.weight"] = out["embed.weight"]
    extra = sorted(set(hf) - set(_hf_names_used(kinds, moe_layers, shapes, tied)))
    if extra:
        raise CheckpointError(f"the Hugging Face checkpoint holds {extra[0]} (and {len(extra) - 1} more), which "
                         f"the config.json model has no place for")
    return out


def _hf_names_used(kinds, moe_layers, shapes, tied) -> set[str]:
    names = {n for o, n in _TOP if o in shapes and not (tied and o == "head.weight")}
    for i, kind in enumerate(kinds):
        pre, hpre = f"layers.{i}.", f"model.layers.{i}."
        pairs = _COMMON + (_KDA + _KDA_CONV + _KDA_FLAT if kind == "K" else _MLA) + \
            (_MOE if i in moe_layers else _DENSE)
        names |= {hpre + n for o, n in pairs if pre + o in shapes}
        if i in moe_layers:
            n_exp = shapes[pre + "ffn.experts.w_gate"][0]
            names |= {expert_name(i, e, p) for e in range(n_exp) for _, p in _EXPERTS}
    return names

