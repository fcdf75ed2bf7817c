"""Whether a k3train model fits transformers' own ``kimi_linear`` (``export-hf --layout kimi_linear``).

transformers' ``KimiLinearForCausalLM`` (read in transformers 5.23,
``models/kimi_linear/modeling_kimi_linear.py``) computes, where k3train differs:

* KDA forget gate ``g = -exp(A_log) * softplus(f + dt_bias)`` (``A_log`` ``[1, 1, H, 1]``,
  unbounded); k3train's safe gate is ``g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``,
  another function of the same inputs for every weight;
* KDA output gate low rank (``g_a_proj [K, d]``, ``g_b_proj [H*K, K]``) and one ``o_norm`` weight
  ``[K]`` for all heads; k3train's is full rank ``[H*K, d]`` with a weight per head ``[H, K]``;
* MLA without an output gate; k3train's MLA multiplies by ``sigmoid(g_proj x)``;
* MoE experts on the full width (fused ``gate_up_proj [E, 2F, d]``), weights scaled by
  ``routed_scaling_factor``; k3train's LatentMoE runs them in a latent width behind
  ``latent_down_proj`` / ``latent_norm`` / ``latent_up_proj``;
* ``hidden_act`` (SiLU) in every MLP and expert; k3train's are SiTU-GLU;
* a plain residual stream and an untied head; k3train may use Block AttnRes and a tied head.

Each layer of a k3train model is KDA or gated MLA, so every model it builds today has at least
the gate misfit: the layout is refused, in one line naming each misfit, and the default layout
(remote code, ``trust_remote_code=True``) is what transformers loads.
"""
from __future__ import annotations

from k3train.config import RunConfig
from k3train.config.layer_pattern import expand_layer_pattern


def kimi_linear_misfits(cfg: RunConfig) -> list[str]:
    """What of ``cfg``'s model has no exact counterpart in transformers' ``kimi_linear``, one
    short phrase each (empty only for a model that fits)."""
    m = cfg.model
    kinds = expand_layer_pattern(m.layer_pattern, m.num_layers)
    out = []
    if m.attnres.enabled:
        out.append("Block AttnRes (model.attnres.enabled=true; kimi_linear has a plain residual)")
    if "K" in kinds:
        out.append("the KDA forget gate (lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); kimi_linear's is "
                   "-exp(A_log) * softplus(f + dt_bias))")
        out.append("the KDA output gate and norm (full rank [H*K, d] and [H, K]; kimi_linear's are rank head_dim "
                   "and one [head_dim] weight)")
    if "M" in kinds:
        out.append("the MLA output gate (sigmoid(g_proj x); kimi_linear's MLA has none)")
    if m.dense_layers < m.num_layers:
        out.append("LatentMoE (experts in a latent width with latent_down/latent_norm/latent_up; kimi_linear's "
                   "experts run on the full width)")
    out.append("SiTU-GLU (kimi_linear's MLPs and experts use hidden_act, SiLU)")
    if m.tie_embeddings:
        out.append("the tied head (model.tie_embeddings=true; kimi_linear never ties)")
    return out
