"""What a routing record keeps for the step (moe/routing_record.py): only what its readers use,
with the balancer updates and loads bit-for-bit those of the whole routing."""
from __future__ import annotations

import pytest
import torch

from moe import BALANCER_NAMES, Balancer, LatentMoE, quantile_balance
from moe.balancing import aux_free_update, reads_step_scores
from moe.metrics import expert_load

E, K, N = 8, 2, 24


def _layer(keep: bool) -> tuple[LatentMoE, list]:
    """A LatentMoE whose router's outputs (the whole routing, the reference) are collected."""
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=16, latent_size=8, num_experts=E, topk=K, expert_ffn_size=8,
                    keep_step_scores=keep).double()
    seen = []
    moe.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    return moe, seen


def _step(moe: LatentMoE, microbatches: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(microbatches):
        moe(torch.randn(N, 16, generator=gen, dtype=torch.float64) * 3).sum().backward()


def test_only_quantile_balancing_reads_the_scores():
    assert [n for n in BALANCER_NAMES if reads_step_scores(n)] == ["quantile"]
    with pytest.raises(ValueError, match="quantile, aux_free, aux_loss, none"):
        reads_step_scores("quantil")


@pytest.mark.parametrize("keep", [True, False], ids=["scores", "ids-only"])
def test_the_step_keeps_int32_ids_and_only_the_scores_it_was_asked_for(keep):
    """Each training forward leaves ``[N, k]`` int32 ids (equal to the router's) and, only with
    ``keep_step_scores``, the router's ``[N, E]`` scores themselves (no copy); no logits or
    weights. An evaluation forward adds nothing."""
    moe, seen = _layer(keep)
    _step(moe)
    with torch.no_grad():
        moe(torch.randn(N, 16, dtype=torch.float64))
    assert len(moe.routing.step) == 3 and len(seen) == 4
    for kept, full in zip(moe.routing.step, seen):
        assert kept.indices.dtype == torch.int32 and torch.equal(kept.indices.long(), full.indices)
        if keep:
            assert kept.scores.data_ptr() == full.scores.data_ptr()
        else:
            assert kept.scores is None
    held = sum(t.untyped_storage().nbytes() for s in moe.routing.step
               for t in (s.indices, s.scores) if t is not None)
    assert held == 3 * N * (K * 4 + (E * 8 if keep else 0))


@pytest.mark.parametrize("name", BALANCER_NAMES)
def test_balancer_update_and_load_equal_those_of_the_whole_routing(name):
    """Bitwise: the bias each balancer writes and the step's load, against the same functions on
    the router's whole outputs of the step's microbatches."""
    moe, seen = _layer(reads_step_scores(name))
    _step(moe)
    scores = torch.cat([o.scores for o in seen]).detach()
    indices = torch.cat([o.indices for o in seen])
    bias = moe.router.bias.clone()
    assert torch.equal(moe.routing.step_load(E), expert_load(indices, E))
    Balancer(name, rate=0.25).update(moe)
    want = {"quantile": quantile_balance(scores, bias, K), "aux_free": aux_free_update(bias, expert_load(indices, E), 0.25),
            "aux_loss": bias, "none": bias}[name]
    assert torch.equal(moe.router.bias, want)


def test_quantile_balancing_on_a_record_without_scores_says_what_is_missing():
    moe, _ = _layer(False)
    _step(moe, 1)
    with pytest.raises(RuntimeError, match="keep_step_scores=True"):
        Balancer("quantile").update(moe)
