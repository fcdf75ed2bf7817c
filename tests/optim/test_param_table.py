"""Parameter table rules and the optimizers built from a table."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optim import (CombinedOptimizer, Muon, ParamRule, apply_lr, build_optimizer,
                   build_param_table, format_table)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.q_proj = nn.Linear(16, 32, bias=False)  # 4 heads of 8 rows
        self.mlp = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 50, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        return self.head(self.norm(self.mlp(h) + self.q_proj(h)[..., :24]))


RULES = [
    ParamRule(r"^embed\.", "adamw", lr_mult=1.0, wd_mult=0.0),
    ParamRule(r"^head\.", "adamw", lr_mult=0.5),
    ParamRule(r"q_proj", "muon", heads=4),
    ParamRule(r"q_proj", "adamw"),  # shadowed by the rule above
    ParamRule(r"\.bias$", "adamw", wd_mult=0.0),
]


def _table(model):
    return {e.name: e for e in build_param_table(model.named_parameters(), RULES)}


def test_first_match_wins_and_defaults():
    t = _table(Tiny())
    assert t["q_proj.weight"].optimizer == "muon" and t["q_proj.weight"].heads == 4
    assert t["embed.weight"].optimizer == "adamw" and t["embed.weight"].wd_mult == 0.0
    assert t["head.weight"].lr_mult == 0.5
    assert t["mlp.weight"].optimizer == "muon" and t["mlp.weight"].heads is None  # default_2d
    assert t["mlp.bias"].optimizer == "adamw" and t["mlp.bias"].wd_mult == 0.0
    assert t["norm.weight"].optimizer == "adamw"  # default_other


def test_non_matrix_muon_rejected_with_name():
    with pytest.raises(ValueError, match="'norm.weight'"):
        build_param_table(Tiny().named_parameters(), [ParamRule(r"norm", "muon")])
    with pytest.raises(ValueError, match="'q_proj.weight'.*heads=5"):
        build_param_table(Tiny().named_parameters(), [ParamRule(r"q_proj", "muon", heads=5)])
    with pytest.raises(ValueError, match="default_other"):
        build_param_table(Tiny().named_parameters(), [], default_other="muon")


def test_unknown_optimizer_names_rejected():
    with pytest.raises(ValueError, match="allowed: muon, adamw"):
        ParamRule(r".*", "sgd")
    with pytest.raises(ValueError, match="allowed: adamw, muon"):
        build_optimizer(list(_table(Tiny()).values()), "lion", lr=1e-3, weight_decay=0.1)


def test_frozen_and_tied_parameters_skipped():
    m = Tiny()
    m.norm.bias.requires_grad_(False)
    named = list(m.named_parameters()) + [("alias.weight", m.mlp.weight)]
    names = [e.name for e in build_param_table(named, RULES)]
    assert "norm.bias" not in names and "alias.weight" not in names
    assert len(names) == len(set(names))


def test_format_table_lists_every_parameter():
    text = format_table(build_param_table(Tiny().named_parameters(), RULES))
    for token in ("name", "shape", "optimizer", "lr x", "wd x", "heads",
                  "q_proj.weight", "32x16", "muon:", "adamw:"):
        assert token in text, token


def test_build_adamw_and_muon_routing():
    m = Tiny()
    table = build_param_table(m.named_parameters(), RULES)
    adamw = build_optimizer(table, "adamw", lr=1e-3, weight_decay=0.1)
    assert [type(o) for o in adamw.optimizers] == [torch.optim.AdamW]

    muon = build_optimizer(table, "muon", lr=1e-3, weight_decay=0.1, muon_lr=2e-3)
    assert [type(o) for o in muon.optimizers] == [Muon, torch.optim.AdamW]
    muon_names = {n for g in muon.optimizers[0].param_groups for n in g["param_names"]}
    assert muon_names == {"q_proj.weight", "mlp.weight"}
    by_name = {n: g for g in muon.param_groups for n in g["param_names"]}
    assert by_name["head.weight"]["lr"] == pytest.approx(5e-4)
    assert by_name["embed.weight"]["weight_decay"] == 0.0
    assert by_name["mlp.weight"]["lr"] == pytest.approx(2e-3)
    assert by_name["q_proj.weight"]["heads"][by_name["q_proj.weight"]["param_names"].index(
        "q_proj.weight")] == 4

    apply_lr(muon, 0.5)
    assert by_name["head.weight"]["lr"] == pytest.approx(2.5e-4)
    assert by_name["mlp.weight"]["lr"] == pytest.approx(1e-3)


def _train(opt: CombinedOptimizer, m: nn.Module, steps: range):
    for k in steps:
        idx = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(k))
        opt.zero_grad()
        m(idx).logsumexp(-1).mean().backward()
        opt.step()


def test_combined_state_dict_resume_bitwise():
    def make():
        torch.manual_seed(0)
        m = Tiny()
        return m, build_optimizer(build_param_table(m.named_parameters(), RULES), "muon",
                                  lr=1e-2, weight_decay=0.1)

    ref_m, ref_opt = make()
    _train(ref_opt, ref_m, range(3))

    m, opt = make()
    _train(opt, m, range(2))
    model_sd, opt_sd = {k: v.clone() for k, v in m.state_dict().items()}, opt.state_dict()

    new_m, new_opt = make()
    new_m.load_state_dict(model_sd)
    new_opt.load_state_dict(opt_sd)
    _train(new_opt, new_m, range(2, 3))
    for (name, p), r in zip(new_m.named_parameters(), ref_m.parameters()):
        assert torch.equal(p, r), name

    with pytest.raises(ValueError, match="optimizer state is for"):
        build_optimizer(build_param_table(Tiny().named_parameters(), RULES), "adamw",
                        lr=1e-2, weight_decay=0.1).load_state_dict(opt_sd)
