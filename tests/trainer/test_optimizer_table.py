"""The K3 parameter table routes every parameter as docs/architecture.md describes (the trainer
step's optimizer table): Muon for the 2-D hidden matrices, per head for the attention
projections, and for the 3-D routed-expert stacks (one matrix per expert); AdamW for embeddings,
head, router, norms, convs, AttnRes queries and the KDA decay terms."""
from __future__ import annotations

from k3train.config import load_config
from k3train.model.model import build_model
from k3train.trainer.optimizer import k3_param_rules
from optim import build_param_table
from tests.helpers import SMALL


def test_k3_table_routes_experts_to_muon_and_gates_to_adamw(world1):
    model = build_model(load_config("configs/k3_tiny.yaml", [*SMALL, "train.device=cpu"]))
    table = {e.name: e for e in build_param_table(model.named_parameters(), k3_param_rules(model, True))}
    experts = [n for n in table if ".experts.w_" in n]
    assert experts and all(table[n].optimizer == "muon" and table[n].param.ndim == 3 for n in experts)
    adamw_words = ("embed.", "head.", "router.", "norm", "A_log", "dt_bias", "_conv", ".query")
    for name, e in table.items():
        if any(w in name for w in adamw_words):
            assert e.optimizer == "adamw", name
        elif e.param.ndim >= 2 and not any(w in name for w in (".b_proj.", ".f_down.", ".f_up.")):
            assert e.optimizer == "muon", name
    per_head = [n for n, e in table.items() if e.heads is not None]
    assert per_head and all(any(f".{w}." in n for w in ("q_proj", "k_proj", "v_proj", "q_up", "kv_up"))
                            for n in per_head)
