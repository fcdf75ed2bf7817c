"""The memory planner (k3train/model/memory_plan.py) against measured and counted memory.

Activations: the planner's op-by-op formulas for the pure-torch forms against the bytes autograd
actually keeps on CPU (distinct saved storages, parameters excluded: tests/k3train/
test_recompute_memory.py), for each layer type (KDA, MLA, dense, MoE, with and without AttnRes)
under each recompute mode: within 15%. Parameters: against the model's own count. Optimizer
state: AdamW 8 and Muon 4 bytes per parameter, ZeRO-1 dividing by dp (experts by dp/ep).
"""
from __future__ import annotations

import pytest

from k3train.config import load_config
from k3train.model.memory_plan import plan_memory
from tests.k3train.test_model import _tiny_cfg
from tests.k3train.test_recompute_memory import saved_bytes

B, T = 2, 32


def _cfg(pattern, dense, attnres, mode, *extra):
    return _tiny_cfg(f"model.layer_pattern={pattern}", "model.num_layers=4", f"model.dense_layers={dense}",
                     "model.hidden_size=64", "model.kda.head_dim=16", "model.mla.q_lora_rank=32",
                     "model.ffn.intermediate_size=128", "moe.latent_size=32", "moe.expert_ffn_size=32",
                     "moe.shared_ffn_size=64", "moe.topk=2", "model.kda.chunk_size=16",
                     f"model.attnres.enabled={attnres}", "model.attnres.block_size=2",
                     f"train.recompute={mode}", f"train.micro_batch_size={B}", f"train.seq_len={T}", *extra)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
@pytest.mark.parametrize("pattern, dense", [("K", 4), ("M", 4), ("K", 0), ("M", 0)],
                         ids=["kda-dense", "mla-dense", "kda-moe", "mla-moe"])
def test_activation_formulas_match_saved_bytes_on_cpu(world1, pattern, dense, attnres, mode):
    cfg = _cfg(pattern, dense, attnres, mode)
    measured = saved_bytes(cfg, batch=B, seq=T)
    predicted = plan_memory(cfg, ops="torch", act_bytes=4)[0].activations[mode]
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured, predicted / measured)
