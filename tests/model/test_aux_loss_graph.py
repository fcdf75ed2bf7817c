"""The switch balance loss (``moe.balancing: aux_loss``) inside the whole model.

Two properties: its gradient still reaches the router, and no autograd graph outlives the
forward in a routing record (a kept graph holds the gradient accumulators of every upstream
parameter; on an H200, CUDA-graph capture after eager warm-up steps failed in backward because
of it). Reference for the gradient: the same model with ``balancing: none`` (identical forward:
the router bias starts at zero either way), plus the balance loss ``E * sum_e f_e P_e``
written out here from the router's captured input.
"""
from __future__ import annotations

import torch

from k3train.model.model import build_model
from tests.helpers import tiny_cfg


def _run(balancing: str):
    cfg = tiny_cfg("model.layer_pattern=KM", "model.dense_layers=1", f"moe.balancing={balancing}")
    torch.manual_seed(0)
    model = build_model(cfg)
    inputs = {}
    last = model.moe_layers()[-1]
    last.router.register_forward_hook(lambda mod, args, out: inputs.__setitem__("x", args[0].detach()))
    tokens = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(3))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return cfg, model, inputs["x"]


def test_aux_loss_gradient_reaches_the_router_and_no_graph_is_kept(world1):
    cfg, model, x = _run("aux_loss")
    _, ref, _ = _run("none")
    for layer in model.moe_layers():
        aux = layer.routing.aux_loss
        assert aux is not None and aux.grad_fn is None and not aux.requires_grad
    # The last MoE layer's router: only its own balance loss differs between the two runs.
    last, ref_last = model.moe_layers()[-1], ref.moe_layers()[-1]
    w = ref_last.router.weight.detach().clone().requires_grad_(True)
    out = last.router(x)  # the recorded routing decisions, for f_e
    scores = torch.sigmoid(x @ w.t())
    e, k = cfg.moe.num_experts, cfg.moe.topk
    f = torch.zeros(e).scatter_add_(0, out.indices.reshape(-1), torch.ones(out.indices.numel())) / (x.shape[0] * k)
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    (expected,) = torch.autograd.grad(cfg.moe.aux_loss_coef * e * (f * p).sum(), w)
    diff = last.router.weight.grad - ref_last.router.weight.grad
    assert expected.abs().max() > 0
    torch.testing.assert_close(diff, expected, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(last.routing.aux_loss, cfg.moe.aux_loss_coef * e * (f * p).sum().detach(),
                               rtol=1e-5, atol=1e-7)
