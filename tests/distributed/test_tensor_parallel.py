"""TP=2 (two gloo processes) equals TP=1: loss and every parameter gradient, in fp64."""
import pytest
import torch
import torch.distributed as dist

from k3train.runtime.distributed import init_distributed
from k3train.model.model import build_model
from tests.helpers import tiny_cfg
from tests.multiproc import run_multiprocess


def _full_grads(model, tp):
    """Gradients with tensor-parallel shards gathered back to full shape."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous())
            g = torch.cat(parts, dim=p.partition_dim)
        out[name] = g
    return out


def _loss_and_grads(tp, attnres):
    init_distributed(tp=tp)
    cfg = tiny_cfg(f"model.attnres.enabled={attnres}", "model.layer_pattern=KM")
    model = build_model(cfg).double()
    torch.manual_seed(5)
    tokens = torch.randint(0, 257, (2, 13))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), _full_grads(model, tp)


def _tp2_equals_tp1(rank, world_size):
    for attnres in (True, False):
        loss2, grads2 = _loss_and_grads(2, attnres)
        loss1, grads1 = _loss_and_grads(1, attnres)
        torch.testing.assert_close(loss2, loss1, rtol=1e-12, atol=1e-12)
        assert grads1.keys() == grads2.keys()
        for name in grads1:
            torch.testing.assert_close(grads2[name], grads1[name], rtol=1e-9, atol=1e-11,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_tensor_parallel_two_ranks_equal_one():
    run_multiprocess(_tp2_equals_tp1, 2)
