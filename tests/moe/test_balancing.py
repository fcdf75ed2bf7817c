"""Quantile Balancing (single and distributed), baselines, Balancer and load metrics."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe import (BALANCER_NAMES, Balancer, LatentMoE, LoadTracker, aux_free_update,
                 expert_load, max_vio, quantile_balance, quantile_balance_distributed)
from tests.multiproc import run_multiprocess


def _scores(n: int, e: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Expert-specific offsets make the unbalanced starting load strongly skewed.
    logits = torch.randn(n, e, generator=g) * 1.5 + torch.randn(e, generator=g) * 1.5
    return torch.sigmoid(logits).to(dtype)


def _brute_thresholds(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Literal reading of the definition with Python lists; arithmetic in the tensors' dtype.

    Returns the uncentred thresholds t_j (new bias before centring is -t_j).
    """
    n, e = scores.shape
    q = n * k // e
    cutoffs = []
    for i in range(n):
        biased = sorted((scores[i, j] + bias[j] for j in range(e)), key=float, reverse=True)
        cutoffs.append(biased[k])                     # (k+1)-th largest biased score
    thresholds = []
    for j in range(e):
        margins = sorted((scores[i, j] - cutoffs[i]).item() for i in range(n))[::-1]
        thresholds.append(margins[q])                 # (q+1)-th largest margin
    return torch.tensor(thresholds, dtype=scores.dtype)


def _centred(thresholds: torch.Tensor) -> torch.Tensor:
    b = -thresholds
    return b - b.mean()


@pytest.mark.parametrize("n,e,k,dtype", [(50, 8, 2, torch.float32), (37, 5, 1, torch.float32),
                                         (64, 16, 4, torch.float64), (6, 4, 3, torch.float32)],
                         ids=["N50-E8-k2", "N37-E5-k1", "N64-E16-k4-fp64", "N6-E4-k3"])
def test_quantile_balance_matches_brute_force(n, e, k, dtype):
    scores = _scores(n, e, seed=n + e + k, dtype=dtype)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(7)) * 0.1).to(dtype)
    new = quantile_balance(scores, bias, k)
    want = _centred(_brute_thresholds(scores, bias, k))
    torch.testing.assert_close(new, want, rtol=0, atol=0)
    assert new.dtype == bias.dtype and abs(new.mean().item()) < 1e-6


def test_quantile_balance_rejects_bad_k_and_keeps_empty_batch():
    with pytest.raises(ValueError, match="0 < k < num_experts"):
        quantile_balance(torch.rand(10, 4), torch.zeros(4), 4)
    bias = torch.randn(4)
    assert torch.equal(quantile_balance(torch.rand(0, 4), bias, 2), bias)


@pytest.mark.parametrize("n,e,k", [(400, 8, 2), (1000, 16, 4), (300, 4, 1)])
def test_quantile_update_rebalances_within_exact_slack(n, e, k):
    """What one update guarantees, exactly, and the slack that remains.

    Old bias 0, cutoffs c_i, margins m_ij = s_ij - c_i, thresholds t_j, q = floor(N k / E).
    (a) Order statistics: #{m_.j > t_j} <= q < #{m_.j >= t_j}. Continuous scores have no
        accidental ties, but there is a structural one: a token's (k+1)-th expert j has
        s_ij + b_j = c_i, i.e. margin exactly -b_j (= 0 here). If expert j's threshold lands
        in that block, j keeps its bias and gets q - T_j .. q votes, T_j = #{m_.j == t_j} - 1.
    (b) Votes V_ij = [s_ij + b'_j > c_i], computed as routing sees them: with the centred
        bias b'' = b' - mu against c_i - mu. The (q+1)-th token of expert j sits exactly on
        the boundary in real arithmetic (b'_j = c_i - s_ij), so rounding decides its vote;
        the tie block (bias 0: s_ij + b'' and c_i - mu are the same float) never votes.
        So q - T_j <= |V_j| <= q + 1. A token with a_i = sum_j V_ij
        votes routes, under b', to a top-k inside its votes if a_i >= k and containing them
        if a_i <= k. Hence
            -#{i: V_ij, a_i > k} <= L_j - |V_j| <= #{i: not V_ij, a_i < k},
        and L_j == |V_j| for all j exactly when every a_i == k. Moving all biases at once
        moves the cutoffs, so the a_i are not all k: one step lands near N*k/E, not on it.
    (c) Loads still sum to N*k, and MaxVio drops well below the unbalanced start.
    """
    scores = _scores(n, e, seed=11)
    bias = torch.zeros(e)
    q = n * k // e
    before = expert_load(torch.topk(scores, k, dim=1).indices, e)
    new_bias = quantile_balance(scores, bias, k)
    picked = torch.zeros(n, e, dtype=torch.bool).scatter_(
        1, torch.topk(scores + new_bias, k, dim=1).indices, True)
    load = picked.sum(0)

    t = _brute_thresholds(scores, bias, k)
    cutoff = torch.topk(scores + bias, k + 1, dim=1).values[:, -1:]
    margins = scores - cutoff
    above, at = (margins > t).sum(0), (margins == t).sum(0)
    assert (above <= q).all() and (above + at > q).all()                     # (a)
    tie_slack = at - 1
    assert ((margins == 0).sum(1) == 1).all()     # the only ties: one runner-up per token
    assert (tie_slack[above < q] > 0).all()       # every shortfall sits on that tie block

    shift = (-t).mean()
    votes = (scores + new_bias) > (cutoff - shift)                           # (b)
    v = votes.sum(0)
    assert ((v >= q - tie_slack) & (v <= q + 1)).all()
    a = votes.sum(1, keepdim=True)
    assert (picked <= votes)[(a >= k).squeeze(1)].all()
    assert (votes <= picked)[(a <= k).squeeze(1)].all()
    lower, upper = -(votes & (a > k)).sum(0), (~votes & (a < k)).sum(0)
    assert ((load - v >= lower) & (load - v <= upper)).all()
    assert load.sum().item() == n * k                                        # (c)
    assert max_vio(load) < 0.5 * max_vio(before)


def test_aux_free_update_direction():
    bias = torch.tensor([0.1, 0.0, -0.1, 0.0])
    new = aux_free_update(bias, torch.tensor([10, 2, 4, 4]), rate=0.01)   # mean load 5
    torch.testing.assert_close(new, torch.tensor([0.09, 0.01, -0.09, 0.01]))
    same = aux_free_update(bias, torch.tensor([3, 3, 3, 3]))
    assert torch.equal(same, bias)


def test_max_vio_and_load_tracker():
    assert max_vio(torch.tensor([2, 2, 2, 2])).item() == 0.0
    assert max_vio(torch.tensor([4, 2, 1, 1])).item() == pytest.approx(1.0)
    assert max_vio([0, 0, 0]).item() == 0.0
    assert expert_load(torch.tensor([[0, 2], [2, 3]]), 5).tolist() == [1, 0, 2, 1, 0]

    tracker = LoadTracker(num_layers=2, num_experts=4)
    tracker.record(0, torch.tensor([4, 2, 1, 1]))            # MaxVio 1
    tracker.record(1, torch.tensor([2, 2, 2, 2]), dropped_tokens=3)
    s = tracker.summary()
    assert s["moe/maxvio"] == pytest.approx(0.5) and s["moe/maxvio_max"] == pytest.approx(1.0)
    assert s["moe/maxvio/layer0"] == pytest.approx(1.0) and s["moe/dropped_tokens"] == 3.0
    tracker.record(0, torch.tensor([0, 2, 3, 3]))            # cumulative [4, 4, 4, 4]
    s = tracker.summary()
    assert s["moe/maxvio"] == pytest.approx(0.5)              # only layer 0 this step: 3/2 - 1
    assert s["moe/maxvio_running"] == pytest.approx(0.0)
    assert s["moe/dropped_tokens"] == 0.0
    assert tracker.load_matrix().tolist() == [[4, 4, 4, 4], [2, 2, 2, 2]]
    assert tracker.load_matrix(running=False).tolist() == [[0, 2, 3, 3], [0, 0, 0, 0]]


def test_load_tracker_reports_the_last_step_and_resumes():
    """end_step closes a step: summary() reports the last one alone (MaxVio and dropped slots),
    the running MaxVio keeps the whole history, and state_dict carries it to a new tracker."""
    tracker = LoadTracker(num_layers=2, num_experts=4)
    tracker.record(0, torch.tensor([4, 2, 1, 1]), dropped_tokens=3)
    tracker.end_step()
    tracker.record(0, torch.tensor([2, 2, 2, 2]), dropped_tokens=5)
    tracker.record(1, torch.tensor([1, 1, 1, 5]))
    tracker.end_step()
    s = tracker.summary()
    assert s["moe/maxvio/layer0"] == 0.0                       # step 2 only, not [6, 4, 3, 3]
    assert s["moe/maxvio/layer1"] == pytest.approx(1.5)       # 5 / 2 - 1
    assert s["moe/maxvio"] == pytest.approx(0.75) and s["moe/dropped_tokens"] == 5.0
    assert s["moe/maxvio_running"] == pytest.approx((0.5 + 1.5) / 2)   # [6, 4, 3, 3]: 6/4 - 1
    assert tracker.summary() == s                              # reading again changes nothing

    resumed = LoadTracker(num_layers=2, num_experts=4)
    resumed.load_state_dict(tracker.state_dict())
    for t in (tracker, resumed):
        t.record(0, torch.tensor([0, 2, 3, 3]))               # cumulative [6, 6, 6, 6]
        t.end_step()
    assert resumed.summary() == tracker.summary()
    assert resumed.summary()["moe/maxvio_running"] == pytest.approx((0.0 + 1.5) / 2)
    assert resumed.load_matrix().tolist() == [[6, 6, 6, 6], [1, 1, 1, 5]]
    with pytest.raises(ValueError, match=r"shape \[2, 4\].*\[3, 4\]"):
        LoadTracker(num_layers=3, num_experts=4).load_state_dict(tracker.state_dict())


def test_balancer_names_and_updates():
    with pytest.raises(ValueError) as err:
        Balancer("quantil")
    for name in BALANCER_NAMES:
        assert name in str(err.value)
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=16, latent_size=8, num_experts=8, topk=2, expert_ffn_size=8)
    with pytest.raises(RuntimeError, match="forward"):
        Balancer("quantile").update(moe)
    x = torch.randn(64, 16) * 3
    moe(x)
    for name in ("none", "aux_loss"):
        Balancer(name).update(moe)
        assert moe.router.bias.abs().sum() == 0
    Balancer("aux_free", rate=0.5).update(moe)
    load = expert_load(moe.routing.last.indices, 8).float()
    torch.testing.assert_close(moe.router.bias, 0.5 * torch.sign(load.mean() - load))
    moe.router.bias.zero_()
    Balancer("quantile").update(moe)
    torch.testing.assert_close(moe.router.bias,
                               quantile_balance(moe.routing.last.scores, torch.zeros(8), 2),
                               rtol=0, atol=0)


# ---------------------------------------------------------------- distributed (2 gloo ranks)

def _distributed_body(rank: int, world: int) -> None:
    cases = [(37, 60, 8, 2), (3, 100, 4, 2), (0, 25, 6, 3)]   # (N_0, N_1, E, k)
    for n0, n1, e, k in cases:
        scores = _scores(n0 + n1, e, seed=5 + e)
        bias = torch.randn(e, generator=torch.Generator().manual_seed(9)) * 0.05
        mine = scores[:n0] if rank == 0 else scores[n0:]
        got = quantile_balance_distributed(mine, bias, k)
        want = quantile_balance(scores, bias, k)
        assert torch.equal(got, want), (n0, n1, got, want)
        both = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(both, got)
        assert torch.equal(both[0], both[1])

    # Balancer with a group: aux_free all-reduces the loads, quantile gathers the margins.
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=16, latent_size=8, num_experts=8, topk=2, expert_ffn_size=8)
    xs = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(3)) * 3
    load = sum(expert_load(moe.router(x).indices, 8) for x in xs).float()  # both ranks, bias 0
    moe(xs[rank])
    group = dist.group.WORLD
    Balancer("aux_free", rate=0.1).update(moe, group=group)
    torch.testing.assert_close(moe.router.bias, 0.1 * torch.sign(load.mean() - load))
    moe.router.bias.zero_()
    moe(xs[rank])
    Balancer("quantile").update(moe, group=group)
    full = quantile_balance(moe.router(xs.reshape(-1, 16)).scores, torch.zeros(8), 2)
    assert torch.equal(moe.router.bias, full)

    # LoadTracker.gathered: each rank holds one layer (as pipeline stages do); the gathered
    # tracker equals one that recorded both layers itself.
    loads = [torch.tensor([3, 1, 0, 0]), torch.tensor([1, 1, 1, 1])]
    mine = LoadTracker(num_layers=2, num_experts=4)
    mine.record(rank, loads[rank] * 2, dropped_tokens=rank + 1)
    mine.end_step()
    mine.record(rank, loads[rank], dropped_tokens=10 * (rank + 1))
    mine.end_step()
    both = LoadTracker(num_layers=2, num_experts=4)
    both.record(0, loads[0] * 2)
    both.record(1, loads[1] * 2)
    both.end_step()
    both.record(0, loads[0], dropped_tokens=30)
    both.record(1, loads[1])
    both.end_step()
    gathered = mine.gathered(group)
    assert gathered.summary() == both.summary()
    assert torch.equal(gathered.load_matrix(), both.load_matrix())


@pytest.mark.slow
def test_quantile_balance_distributed_two_ranks():
    run_multiprocess(_distributed_body, 2)
