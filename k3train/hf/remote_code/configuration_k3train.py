"""Configuration of a k3train Hugging Face export, for ``transformers`` (``trust_remote_code``).

Copied by ``k3train export-hf`` beside ``config.json``; imports only ``transformers``. The
exact model is described by the ``k3train`` section of ``config.json`` (k3train's ``model`` and
``moe`` config, what ``k3train import`` rebuilds from) and the ``situ`` section (the SiTU
betas); the HF-style top-level fields (sizes, ``linear_attn_config``) are informative.
"""
from transformers import PretrainedConfig


class K3Config(PretrainedConfig):
    """``config.json`` of a k3train export (``model_type: k3train_k3``).

    k3train: ``{"model": ..., "moe": ..., "data": ...}``, k3train's config sections;
    situ: ``{"ffn_beta", "ffn_beta_lin", "expert_beta", "expert_beta_lin"}``.
    """

    model_type = "k3train_k3"

    def __init__(self, k3train: dict | None = None, situ: dict | None = None, **kwargs):
        self.k3train = k3train or {}
        self.situ = situ or {}
        # The whole sequence is recomputed at each generated token: there is no KV/state cache.
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)
