"""k3train: a Megatron-style trainer for Kimi-K3-style hybrid linear-attention MoE models."""

__version__ = "0.1.0"
