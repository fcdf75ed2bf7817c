"""A toy parameter table and per-rank gradients shared by the optimizer tests."""
from __future__ import annotations

import torch

from optim import ParamRule, build_param_table


HP = dict(lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


RULES = [ParamRule(r"^embed\.", "adamw", wd_mult=0.0), ParamRule(r"^head\.", "adamw", lr_mult=0.5),
         ParamRule(r"q_proj", "muon", heads=4), ParamRule(r"(bias|A_log)$", "adamw", wd_mult=0.0),
         ParamRule(r"^experts\.w_in$", "muon")]   # a 3-D expert stack [E, A, B] on Muon


# Odd AdamW total (88 + 8 + 24 + 3 + 88 = 211 elements) so every DP size pads its last shard.
SHAPES = {"embed.weight": (11, 8), "attn.q_proj.weight": (16, 8), "attn.A_log": (3,),
          "mlp.up.weight": (24, 8), "mlp.up.bias": (24,), "mlp.down.weight": (8, 24),
          "norm.weight": (8,), "head.weight": (11, 8)}


EXPERT_SHAPES = {"experts.w_in": (2, 8, 6), "experts.w_out": (12, 8)}


def make_table(seed: int, shapes=SHAPES):
    """Fresh parameters (values from ``seed``) and their table."""
    gen = torch.Generator().manual_seed(seed)
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in shapes.items()]
    return build_param_table(named, RULES)


def grads_for(table, rank: int, step: int, salt: int = 0) -> list[torch.Tensor]:
    """The gradient rank ``rank`` computes at ``step``: different on every rank."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + salt)
    return [torch.randn(e.shape, generator=gen) for e in table]


def set_grads(table, grads) -> None:
    for e, g in zip(table, grads):
        e.param.grad = g.clone()
