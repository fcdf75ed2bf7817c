"""The model's sections of the run configuration: ``model`` (KDA, MLA, AttnRes, FFN) and ``moe``."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from k3train.config.strict import StrictModel


class KDAConfig(StrictModel):
    """Kimi Delta Attention sublayer."""

    num_heads: int = Field(4, ge=1)
    """KDA heads (H)."""
    head_dim: int = Field(64, ge=1)
    """Key and value head dimension (K = V)."""
    conv_size: int = Field(4, ge=1)
    """Kernel of the causal depthwise short convolution on q, k, v."""
    gate_lower_bound: float = Field(-5.0, lt=0)
    """K3 "safe" gate: g = lower_bound * sigmoid(...) so each step keeps at least exp(lower_bound)."""
    gate: Literal["channel", "head"] = "channel"
    """channel: KDA's forget gate, one decay per key channel (low rank d -> head_dim -> H*K).
    head: one decay per head (d -> H, the same for every channel), as Gated DeltaNet: the same
    delta rule with a scalar gate, for ablations (Kimi Linear reports KDA ahead of it on recall).
    Not in the Hugging Face format, which has KDA's gate."""
    chunk_size: int = Field(64, ge=1)
    """Chunk length of the pure-torch chunked kernel (CPU path)."""


class MLAConfig(StrictModel):
    """Gated multi-head latent attention sublayer (NoPE)."""

    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    q_lora_rank: int = Field(128, ge=1)
    """Width of the query's low-rank down-projection (q_down)."""
    kv_lora_rank: int = Field(128, ge=1)
    """Width of the compressed key-value latent c_kv (what the inference cache keeps)."""
    qk_nope_head_dim: int = Field(64, ge=1)
    """Per-head key/query width computed from the latent."""
    qk_rope_head_dim: int = Field(32, ge=0)
    """Width of the key part shared by all heads (DeepSeek's rope part; no rotary is applied)."""
    v_head_dim: int = Field(64, ge=1)
    """Per-head value width."""


class AttnResConfig(StrictModel):
    """Block Attention Residuals over depth."""

    enabled: bool = True
    """False gives the standard pre-norm residual baseline."""
    block_size: int = Field(2, ge=1)
    """Transformer layers (attention + FFN) per AttnRes block."""


class FFNConfig(StrictModel):
    """Dense SiTU-GLU feed-forward (the first ``dense_layers`` layers)."""

    intermediate_size: int = Field(512, ge=1)
    """Hidden width of the dense SiTU-GLU."""
    situ_beta: float = Field(4.0, gt=0)
    """SiTU's gate sharpness beta."""
    situ_beta_lin: float = Field(25.0, gt=0)
    """SiTU's linear-branch beta."""


class ModelConfig(StrictModel):
    vocab_size: int = Field(320, ge=2)
    """Embedding rows; must be >= the tokenizer's vocabulary (extra rows are never targets)."""
    hidden_size: int = Field(256, ge=1)
    """Residual stream width (d)."""
    num_layers: int = Field(8, ge=1)
    """Transformer layers (a mixer and an FFN each)."""
    layer_pattern: str = "KKKM"
    """K = KDA, M = gated MLA. Either one unit repeated to ``num_layers`` ("KKKM") or terms
    joined by '+' with repeat counts whose lengths add up to ``num_layers`` ("KKKM*21+KKM*3")."""
    dense_layers: int = Field(1, ge=0)
    """The first N layers use a dense SiTU-GLU FFN, the rest LatentMoE."""
    tie_embeddings: bool = False
    """Share the embedding and the LM head (pp = 1 only)."""
    init_std: float = Field(0.02, gt=0)
    """Standard deviation of the normal weight initialisation."""
    norm_eps: float = Field(1e-6, gt=0)
    """Epsilon of every RMSNorm."""
    kda: KDAConfig = KDAConfig()
    mla: MLAConfig = MLAConfig()
    attnres: AttnResConfig = AttnResConfig()
    ffn: FFNConfig = FFNConfig()


class MoEConfig(StrictModel):
    """Stable LatentMoE layers and their load balancing."""

    num_experts: int = Field(8, ge=1)
    """Routed experts per MoE layer."""
    topk: int = Field(2, ge=1)
    """Experts each token is routed to."""
    latent_size: int = Field(128, ge=1)
    """Width of the latent the routed experts work in (LatentMoE's down-projection)."""
    expert_ffn_size: int = Field(128, ge=1)
    """Hidden width of each routed expert's SiTU-GLU."""
    num_shared_experts: int = Field(1, ge=0)
    """Always-on shared experts per MoE layer."""
    shared_ffn_size: int = Field(256, ge=1)
    """Hidden width of each shared expert."""
    balancing: Literal["quantile", "aux_free", "aux_loss", "none"] = "quantile"
    """Load balancing: quantile (Quantile Balancing), aux_free (bias update), aux_loss (switch loss) or none."""
    aux_free_rate: float = Field(1e-3, gt=0)
    """Bias step of aux_free balancing."""
    aux_loss_coef: float = Field(1e-2, ge=0)
    """Weight of the switch-style balance loss; used only with ``balancing: aux_loss``."""
    dispatcher: Literal["auto", "local", "grouped_a2a"] = "auto"
    """auto: local when parallel.ep == 1 and no capacity_factor is set, else grouped_a2a (one
    all-to-all of counts and one of tokens per direction over the expert-parallel group)."""
    capacity_factor: float | None = Field(None, gt=0)
    """None: dynamic split sizes, exact, no token dropped, one host sync per layer on GPU (the
    default, so results never depend on the EP size). A number: fixed per-(rank, expert)
    capacity ceil(c*N*k/E), no host sync, overflow dropped and counted in moe/dropped_tokens."""

    @model_validator(mode="after")
    def _topk_fits(self) -> "MoEConfig":
        if self.topk >= self.num_experts:
            raise ValueError(f"moe.topk ({self.topk}) must be smaller than moe.num_experts ({self.num_experts})")
        return self
