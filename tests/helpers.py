"""Configs and readers shared by the test modules (test modules never import each other)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from k3train.config import load_config
from k3train.model.model import build_model


SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=32",
         "model.mla.num_heads=2", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
         "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
         "model.ffn.intermediate_size=128", "moe.num_experts=4", "moe.latent_size=32",
         "moe.expert_ffn_size=32", "moe.shared_ffn_size=64", "train.seq_len=32", "train.micro_batch_size=4",
         "train.eval_batches=2", "logging.wandb.mode=disabled", "logging.progress_bar=false",
         # The end-of-run PNGs cost ~0.7 s a run; the tests of the plots turn them back on.
         "train.plots=false"]


def small_cfg(*extra):
    """configs/k3_tiny.yaml shrunk for fast end-to-end runs (``SMALL``), plus ``extra`` overrides."""
    return load_config("configs/k3_tiny.yaml", [*SMALL, *extra])


def read_records(run_dir):
    """A run directory's metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tiny_cfg(*extra):
    """A 4-layer model small enough for fp64 parity tests (the schema's defaults otherwise)."""
    return load_config(None, [
        "model.hidden_size=32", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=8",
        "model.mla.num_heads=2", "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16",
        "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8",
        "model.ffn.intermediate_size=32", "moe.num_experts=4", "moe.latent_size=16",
        "moe.expert_ffn_size=16", "moe.shared_ffn_size=16", "train.plots=false", *extra])


class SavedBytes:
    """Bytes of the distinct non-parameter storages saved for backward while active."""

    def __init__(self, params=()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def saved_bytes(cfg, batch: int = 2, seq: int = 32) -> int:
    """Activation bytes one training forward of ``cfg``'s whole model keeps (CPU, fp32)."""
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    saved = SavedBytes(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return saved.total


def readme_commands(readme: str | Path = "README.md") -> list[str]:
    """The command lines of the README's opening ``bash`` block (set-up, quickstart, tests)."""
    text = Path(readme).read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.strip() for line in block.strip().splitlines()]


def allocator_peak(fn) -> tuple[int, int]:
    """(peak, net) bytes the CPU allocator held above its level before ``fn()``, from the
    profiler's memory events in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, live
