"""The planner's routing-record terms against what a model built from the config holds, for
every balancer: the step's records (``records_bytes_per_token``: int32 ids, and ``[E]`` scores
only under quantile balancing) and each record's last forward (``routing_last_bytes_per_token``).
A record that kept an ``[N, E]`` tensor no reader needs (the logits, or the scores without the
quantile balancer) fails the first test."""
from __future__ import annotations

import pytest
import torch

from k3train.config import load_config
from k3train.model.model import build_model
from k3train.profiling.activation_bytes import records_bytes_per_token, routing_last_bytes_per_token
from moe import BALANCER_NAMES
from tests.helpers import tiny_cfg

T, M = 16, 3


def _run(name: str):
    cfg = tiny_cfg("moe.num_experts=8", "moe.topk=2", "model.dense_layers=1", f"moe.balancing={name}",
                   f"train.seq_len={T}")
    torch.manual_seed(0)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(0)
    for _ in range(M):
        x = torch.randint(0, cfg.model.vocab_size, (1, T + 1), generator=gen)
        model(x[:, :-1], x[:, 1:]).backward()
    return cfg, model


def _bytes(tensors) -> int:
    """Bytes of the distinct storages among ``tensors`` (None skipped)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values())


@pytest.mark.parametrize("name", BALANCER_NAMES)
def test_records_hold_what_the_planner_counts_for_each_balancer(world1, name):
    """After 3 training forwards of a 4-layer model (3 MoE layers, fp32): the step's records
    hold 3 x 16 tokens x the planner's bytes per token exactly (24 B under quantile: 8 scores of
    4 B and 2 int32 ids; 8 B otherwise), and the last forward's routing beyond them one
    microbatch of ``routing_last_bytes_per_token`` exactly."""
    cfg, model = _run(name)
    layers = list(range(cfg.model.num_layers))
    records = [layer.routing for layer in model.moe_layers()]
    assert len(records) == 3 and all(len(r.step) == M for r in records)
    step = _bytes(t for r in records for s in r.step for t in (s.indices, s.scores))
    per_token = records_bytes_per_token(cfg, layers, 4)
    assert per_token == 3 * (2 * 4 + (8 * 4 if name == "quantile" else 0))
    assert step == per_token * M * T
    everything = _bytes(t for r in records for t in (*(x for s in r.step for x in (s.indices, s.scores)),
                                                     r.last.scores, r.last.indices, r.last.weights, r.last.logits))
    assert everything - step == routing_last_bytes_per_token(cfg, layers, 4) * T


def test_the_k3_plan_counts_the_scores_its_quantile_balancer_keeps():
    """configs/k3_full.yaml balances with the quantile balancer, the one reader of the scores: per
    MoE layer in bf16 the step keeps 896 scores of 2 bytes and 16 int32 ids (1,856 B per token;
    3,744 with the whole routing), 64 B under aux_free; the last forward adds its logits, weights
    and int64 ids (and the scores where the step has none)."""
    cfg = load_config("configs/k3_full.yaml")
    assert cfg.moe.balancing == "quantile" and (cfg.moe.num_experts, cfg.moe.topk) == (896, 16)
    first = cfg.model.dense_layers
    assert records_bytes_per_token(cfg, [first - 1, first], 2) == 896 * 2 + 16 * 4 == 1856
    assert routing_last_bytes_per_token(cfg, [first], 2) == 896 * 2 + 16 * 2 + 16 * 8
    aux_free = load_config("configs/k3_full.yaml", ["moe.balancing=aux_free"])
    assert records_bytes_per_token(aux_free, [first], 2) == 64
    assert routing_last_bytes_per_token(aux_free, [first], 2) == 2 * 896 * 2 + 16 * 2 + 16 * 8
