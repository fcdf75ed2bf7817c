"""Forward state (k3train/model/forward_state.py): every state a forward leaves behind is held by
a ``ForwardState`` holder, and recompute and the CUDA-graph wrapper snapshot the same holders.

The independent reference for "no other forward state" is a census of every module's and
every attached plain object's attributes (identity, and length for containers) before and after
a forward+backward: an attribute that changed on an object that is not a holder is forward state
nobody would snapshot.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from k3train.config import load_config
from k3train.model.attnres import DepthAttention, DepthWeights, record_depth_weights
from k3train.model.forward_state import ForwardState, forward_state_holders, is_forward_state
from k3train.model.model import build_model
from k3train.trainer import cuda_graph
from moe import LatentMoE, RoutingRecord

EXACT = dict(rtol=0, atol=0)


def _cfg(recompute: str, *extra):
    # KDA and MLA layers, one dense layer then MoE layers behind the static all-to-all dispatcher
    # (it drops slots), the balance loss, AttnRes blocks of 2 layers.
    return load_config(None, [
        "model.hidden_size=32", "model.num_layers=4", "model.layer_pattern=KM", "model.dense_layers=1",
        "model.kda.num_heads=2", "model.kda.head_dim=8", "model.mla.num_heads=2",
        "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
        "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8", "model.ffn.intermediate_size=32",
        "moe.num_experts=4", "moe.latent_size=16", "moe.expert_ffn_size=16", "moe.shared_ffn_size=16",
        "moe.balancing=aux_loss", "moe.capacity_factor=0.5", "model.attnres.block_size=2",
        f"train.recompute={recompute}", *extra])


def _tokens():
    return torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(3))


def _objects(root: nn.Module) -> list:
    """Every module of ``root`` and every plain object (not a tensor, module or container) held
    by one of them."""
    objs, seen = [], set()
    for m in root.modules():
        for obj in (m, *vars(m).values()):
            plain = hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type))
            if plain and id(obj) not in seen:
                seen.add(id(obj))
                objs.append(obj)
    return objs


def _census(obj) -> dict:
    return {k: (id(v), len(v) if isinstance(v, (list, dict)) else None) for k, v in vars(obj).items()}


def undeclared_forward_state(root: nn.Module, run) -> list[str]:
    """``Class.attribute`` of each attribute ``run()`` changed on an object of ``root`` that is
    not a forward-state holder."""
    objs = [o for o in _objects(root) if not is_forward_state(o)]
    before = [_census(o) for o in objs]
    run()
    found = []
    for obj, was in zip(objs, before):
        now = _census(obj)
        found += [f"{type(obj).__name__}.{k}" for k in sorted(was.keys() | now.keys()) if was.get(k) != now.get(k)]
    return found


def _fwd_bwd(model, tokens):
    def run():
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return run


class _Leaky(nn.Module):
    """Keeps its last input's sum: forward state that implements no protocol."""

    def forward(self, x):
        self.last_sum = x.detach().sum()
        return x


class _Declared(nn.Module):
    """The same, declared as a holder."""

    def forward(self, x):
        self.last_sum = x.detach().sum()
        return x

    def forward_state(self) -> dict:
        return {"last_sum": getattr(self, "last_sum", None)}

    def load_forward_state(self, state: dict) -> None:
        self.last_sum = state["last_sum"]


def test_the_census_catches_forward_state_outside_the_protocol():
    model = nn.Sequential(nn.Linear(3, 3), _Leaky(), _Declared())
    x = torch.randn(2, 3)
    assert undeclared_forward_state(model, lambda: model(x)) == ["_Leaky.last_sum"]
    assert [type(h) for h in forward_state_holders(model)] == [_Declared]
    assert isinstance(model[2], ForwardState) and not isinstance(model[1], ForwardState)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_every_forward_state_of_the_model_is_a_holder(world1, recompute):
    torch.manual_seed(0)
    model = build_model(_cfg(recompute))
    tokens = _tokens()
    _fwd_bwd(model, tokens)()      # warm-up: what a first call sets up once is not state
    assert undeclared_forward_state(model, _fwd_bwd(model, tokens)) == []
    with record_depth_weights(model):
        assert undeclared_forward_state(model, _fwd_bwd(model, tokens)) == []
    # Nothing is left on the dispatchers between calls; the layers' records hold the drops.
    for layer in model.moe_layers():
        assert not hasattr(layer.dispatcher, "dropped_tokens")
        assert len(layer.routing.step_dropped) == 3 and int(layer.routing.last_dropped) > 0


def test_recompute_and_the_graph_snapshot_the_same_holders(world1):
    model = build_model(_cfg("full"))
    records = [layer.routing for layer in model.moe_layers()]
    assert forward_state_holders(model) == records              # what state.py hands the graph
    assert all(isinstance(r, RoutingRecord) for r in records)
    per_layer = [h for layer in model.layers for h in forward_state_holders(layer)]
    assert per_layer == records                                 # what each recompute region takes
    with record_depth_weights(model) as rec:
        holders = forward_state_holders(model)
        assert [h for h in holders if isinstance(h, DepthWeights)] == [rec]
        assert {id(h) for layer in model.layers for h in forward_state_holders(layer)} == {id(h) for h in holders}
    assert forward_state_holders(model) == records              # the recorder is gone after the block


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_records_each_forward_once(world1, recompute):
    """Routing, drops and recorded depth weights after a recomputed step equal those of a step
    without recompute, bitwise (fp32 CPU: the same ops on the same inputs)."""
    tokens = _tokens()
    got = {}
    for mode in ("none", recompute):
        torch.manual_seed(0)
        model = build_model(_cfg(mode))
        with record_depth_weights(model) as rec:
            _fwd_bwd(model, tokens)()
        got[mode] = (model, rec)
    (ref, ref_rec), (model, rec) = got["none"], got[recompute]
    for layer, ref_layer in zip(model.moe_layers(), ref.moe_layers(), strict=True):
        r, q = layer.routing, ref_layer.routing
        assert len(r.step) == len(q.step) == 1 and len(r.step_dropped) == len(q.step_dropped) == 1
        torch.testing.assert_close(r.step[0].indices, q.step[0].indices, **EXACT)
        torch.testing.assert_close(r.step_dropped[0], q.step_dropped[0], **EXACT)
    depth = [m for m in model.modules() if isinstance(m, DepthAttention)]
    ref_depth = [m for m in ref.modules() if isinstance(m, DepthAttention)]
    assert len(rec.weights) == len(ref_rec.weights) == len(depth) == 9     # 2 per layer + final
    for m, q in zip(depth, ref_depth, strict=True):
        torch.testing.assert_close(rec.weights[m], ref_rec.weights[q], **EXACT)
        assert m.recorder is None


def test_depth_weights_are_returned_by_the_context_manager(world1):
    """rec.weights against the softmax over depth computed by hand from the module's inputs."""
    model = build_model(_cfg("none"))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DepthAttention):
                m.query.normal_()
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod, args[0]))
             for m in model.modules() if isinstance(m, DepthAttention)]
    tokens = _tokens()
    with torch.no_grad(), record_depth_weights(model) as rec:
        model(tokens[:, :-1], tokens[:, 1:])
    for h in hooks:
        h.remove()
    assert rec.weights.keys() == inputs.keys()
    for m, sources in inputs.items():
        v = torch.stack([s.float() for s in sources])                       # [S, B, T, D]
        normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + m.eps)
        want = torch.softmax(normed @ m.query.float(), dim=0).mean(dim=(1, 2))  # [S]
        torch.testing.assert_close(rec.weights[m], want, rtol=1e-5, atol=1e-6)
    assert abs(float(sum(w.sum() for w in rec.weights.values())) - len(rec.weights)) < 1e-4


class _FakeGraph:
    """CPU stand-in for torch.cuda.CUDAGraph: capture runs the step eagerly, replay does nothing
    (a real replay refills the captured tensors in place, which the restore re-attaches)."""

    def replay(self):
        pass


def test_the_graph_wrapper_restores_the_captured_forward_state(world1, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    model = build_model(_cfg("none"))
    params = [p for p in model.parameters() if p.requires_grad]

    def fwd_bwd(batch):
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        return loss.detach()

    graphed = cuda_graph.GraphedForwardBackward(fwd_bwd, params, forward_state_holders(model), warmup=0)
    tokens = _tokens()
    graphed(tokens)                                   # the capture
    captured = [(r.step[0], r.step_dropped[0], r.last) for r in (l.routing for l in model.moe_layers())]
    for layer in model.moe_layers():                  # what the trainer does after a step
        layer.routing.clear()
    with torch.no_grad():
        model(tokens[:, :-1], tokens[:, 1:])          # an evaluation forward moves last_*
    graphed(tokens)                                   # a replay
    for layer, (step, dropped, last) in zip(model.moe_layers(), captured, strict=True):
        assert layer.routing.step == [step] and layer.routing.step_dropped == [dropped]
        assert layer.routing.last is last
    assert isinstance(model.moe_layers()[0], LatentMoE)
