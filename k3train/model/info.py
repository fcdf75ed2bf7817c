"""Parameter counts per component, total and activated per token (``k3train model-info``)."""
from __future__ import annotations

import torch.nn as nn

from k3train.config import RunConfig
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.model import build_model

COMPONENTS = ("embedding", "head", "kda", "mla", "attnres", "norms", "dense_ffn", "router",
              "latent_proj", "routed_experts", "shared_experts")


def _component(name: str) -> str:
    """Component of a parameter outside the token mixers (those are classified by module type)."""
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("head."):
        return "head"
    if "_res." in name or name.startswith("final_res."):
        return "attnres"
    if name.startswith("final_norm.") or "_norm." in name:
        return "norms"
    for part in ("router", "experts", "shared"):
        if f".ffn.{part}." in name:
            return {"router": "router", "experts": "routed_experts", "shared": "shared_experts"}[part]
    if ".ffn.down." in name or ".ffn.up." in name or ".ffn.norm." in name:
        return "latent_proj"
    return "dense_ffn"


def count_parameters(model: nn.Module, topk: int, num_experts: int) -> dict:
    """Counts by component plus ``total`` and ``activated`` (routed experts count k/E of their
    parameters; everything else is used by every token). Tied weights are counted once.
    ``model``: a ``K3Chunk`` (the whole model or one pipeline chunk)."""

    mixer_of = {id(p): "kda" if isinstance(layer.mixer, KimiDeltaAttention) else "mla"
                for layer in getattr(model, "layers", []) for p in layer.mixer.parameters()}
    counts = dict.fromkeys(COMPONENTS, 0)
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        counts[mixer_of.get(id(p)) or _component(name)] += p.numel()
    total = sum(counts.values())
    routed = counts["routed_experts"]
    counts["total"] = total
    counts["activated"] = total - routed + routed * topk // num_experts
    return counts


def model_info(cfg: RunConfig) -> tuple[dict, list[str]]:
    """Build the model on the meta device (no memory) and count; returns (counts, assumptions)."""
    import torch

    with torch.device("meta"):
        model = build_model(cfg)
    counts = count_parameters(model, cfg.moe.topk, cfg.moe.num_experts)
    counts["activated_excluding_embeddings"] = counts["activated"] - counts["embedding"] - counts["head"]
    assumptions = [
        "activated = every non-routed parameter + topk/num_experts of the routed experts "
        "(embedding and head included; the figure without them is also shown)",
        f"tensor parallel size 1 (counts are of the whole model), tie_embeddings={cfg.model.tie_embeddings}",
    ]
    return counts, assumptions


def format_info(counts: dict, assumptions: list[str]) -> str:
    lines = [f"{'component':<32}{'parameters':>20}"]
    for key in (*COMPONENTS, "total", "activated", "activated_excluding_embeddings"):
        if key in counts:
            lines.append(f"{key:<32}{counts[key]:>20,}  ({_human(counts[key])})")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in assumptions]
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
