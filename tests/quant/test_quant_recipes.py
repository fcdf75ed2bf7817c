"""Precision recipes: scope selection, MX QAT experts against a written-out reference, a QAT
training run against fp32, fp8 refusal on CPU, and the packed MXFP4 export round trip."""
import contextlib
import json
import re

import pytest
import torch

from k3train.cli import build_parser
from k3train.config import load_config
from k3train.config.schema import PrecisionConfig
from k3train.ops.layers import ColumnLinear
from k3train.model.model import build_model
from k3train.quant.export import load_mxfp4_export
from k3train.quant.mx import fake_quant_mx
from k3train.quant.qat import mx_qat_linear
from k3train.quant.recipes import validate_precision
from k3train.quant.spec import MX_SPECS, MXLinear
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.state_io import consolidated_state
from k3train.trainer.loop import train
from moe import GroupedExperts

from tests.helpers import SMALL

MOE_LAYERS = (1, 2, 3)  # SMALL: 4 layers, the first dense


def small_cfg(*extra):
    return load_config("configs/k3_tiny.yaml", [*SMALL, "train.device=cpu", *extra])


def _scope(*patterns):
    return "precision.scope=" + json.dumps(list(patterns))


def test_default_scope_is_exactly_the_routed_experts(world1):
    model = build_model(small_cfg("precision.recipe=mxfp4_qat"))
    assert model.quantized == [f"layers.{i}.ffn.experts" for i in MOE_LAYERS]
    for name, mod in model.named_modules():
        if isinstance(mod, GroupedExperts):
            assert mod.weight_quant is not None and mod.act_quant is not None, name
        assert not isinstance(mod, MXLinear), name
        if isinstance(mod, ColumnLinear):
            assert mod.quant is None, name


def test_fp32_recipe_builds_the_bf16_model_and_turns_autocast_off(world1):
    torch.manual_seed(0)
    plain = build_model(small_cfg())
    torch.manual_seed(0)
    fp32 = build_model(small_cfg("precision.recipe=fp32"))
    assert fp32.quantized == []
    for (name, a), (_, b) in zip(plain.named_parameters(), fp32.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # The trainer's autocast context is the only difference, and on CUDA it is off for fp32.
    from k3train.trainer.state import autocast_for

    assert isinstance(autocast_for(small_cfg("precision.recipe=fp32"), torch.device("cuda")), contextlib.nullcontext)
    assert isinstance(autocast_for(small_cfg(), torch.device("cuda")), torch.autocast)
    assert isinstance(autocast_for(small_cfg(), torch.device("cpu")), contextlib.nullcontext)


def test_custom_scope_selects_what_it_names(world1):
    model = build_model(small_cfg("precision.recipe=mxfp8", _scope(r"\.ffn\.shared$", r"^layers\.0\.ffn\.up_proj$")))
    shared = [f"layers.{i}.ffn.shared.{p}_proj" for i in MOE_LAYERS for p in ("gate", "up", "down")]
    assert sorted(model.quantized) == sorted(shared + ["layers.0.ffn.up_proj"])
    lin = model.get_submodule("layers.1.ffn.shared.gate_proj")
    assert isinstance(lin, MXLinear) and lin.spec == MX_SPECS["mxfp8"]
    assert model.get_submodule("layers.1.ffn.experts").weight_quant is None
    # The dense TP linear at tp=1 computes F.linear on fake-quantised operands.
    up = model.get_submodule("layers.0.ffn.up_proj")
    x = torch.randn(2, 5, 64)
    assert torch.equal(up(x), mx_qat_linear(x, up.weight, None, "e4m3", "e4m3"))
    # Checkpoints are interchangeable with the full-precision model.
    assert model.state_dict().keys() == build_model(small_cfg()).state_dict().keys()


@pytest.mark.parametrize("pattern", [r"\.ffn\.nothing_here$", r"\.ffn\.router$"])
def test_scope_pattern_selecting_nothing_raises(world1, pattern):
    with pytest.raises(ValueError, match=re.escape(repr(pattern))):
        build_model(small_cfg("precision.recipe=mxfp4_qat", _scope(pattern)))


def _reference_experts(x, counts, w_gate, w_up, w_down, beta, beta_lin):
    """Per-expert loop on operands fake-quantised by hand: weights blocked along dim 1 (the
    reduction dim of x @ w[e]), activations along their last dim; STE written as
    ``v + (q(v) - v).detach()``."""
    from moe.activations import situ_glu

    def ste(v, q):
        return v + (q - v).detach()

    def wq(w):
        return ste(w, fake_quant_mx(w.transpose(1, 2), "e2m1").transpose(1, 2))

    def aq(v):
        return ste(v, fake_quant_mx(v, "e4m3"))

    g, u, d = wq(w_gate), wq(w_up), wq(w_down)
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = aq(x[start:start + n])
        h = aq(situ_glu(xe @ g[e], xe @ u[e], beta, beta_lin))
        outs.append(h @ d[e])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_qat_grouped_experts_match_reference_forward_and_ste_grads(path):
    spec = MX_SPECS["mxfp4_qat"]
    experts = GroupedExperts(3, 64, 32, init_std=0.1, weight_quant=spec.grouped_weight,
                             act_quant=spec.activation)
    counts = [5, 0, 9]  # includes an empty expert
    x = torch.randn(sum(counts), 64, requires_grad=True)
    tpe = torch.tensor(counts)
    fwd = experts.forward if path == "grouped" else experts.forward_loop
    y = fwd(x, tpe)
    grad_out = torch.randn_like(y)
    params = (experts.w_gate, experts.w_up, experts.w_down)
    got = torch.autograd.grad(y, (x, *params), grad_out)

    ref_params = [p.detach().clone().requires_grad_() for p in params]
    x_ref = x.detach().clone().requires_grad_()
    y_ref = _reference_experts(x_ref, counts, *ref_params, experts.beta, experts.beta_lin)
    want = torch.autograd.grad(y_ref, (x_ref, *ref_params), grad_out)
    # The loop path does the reference's exact ops; _grouped_mm may sum in another order.
    tol = dict(rtol=0, atol=0) if path == "loop" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, y_ref, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    # Quantisation is really on: the full-precision experts give a different answer.
    experts.weight_quant = experts.act_quant = None
    assert (experts.forward_loop(x, tpe) - y).abs().max() > 1e-4


@pytest.mark.slow
def test_qat_run_learns_and_tracks_fp32(tmp_path):
    run = ["train.steps=30", "train.log_interval=5", "train.eval_interval=30", "optim.warmup_steps=5"]
    fp32 = train(small_cfg(*run), tmp_path / "fp32")
    qat = train(small_cfg(*run, "precision.recipe=mxfp4_qat"), tmp_path / "qat")
    assert qat["last_loss"] < qat["first_loss"] - 1.5
    # Measured on this config (seeds 1234 and 7): final-loss gap 0.0023 and 0.0016 nats.
    assert abs(qat["last_loss"] - fp32["last_loss"]) < 0.05
    assert qat["first_loss"] != fp32["first_loss"]  # the QAT forward really differs


def test_fp8_on_cpu_raises_a_clear_error(world1):
    with pytest.raises(ValueError, match=r"CUDA GPU with compute capability >= 8\.9.*pip install"):
        validate_precision(PrecisionConfig(recipe="fp8"), "cpu")
    with pytest.raises(ValueError, match="precision.recipe=fp8 needs a CUDA GPU"):
        build_model(small_cfg("precision.recipe=fp8"))


def _export_cli(argv):
    """The ``k3train export-mxfp4`` command, parsed by the CLI's own parser."""
    args = build_parser().parse_args(["export-mxfp4", *argv])
    return args.fn(args)


def test_export_round_trip(tmp_path):
    run_dir = tmp_path / "run"
    train(small_cfg("train.steps=3", "precision.recipe=mxfp4_qat"), run_dir)
    out = tmp_path / "export"
    assert _export_cli(["--checkpoint", str(run_dir / "checkpoints"), "--out", str(out)]) == 0
    meta = json.loads((out / "export.json").read_text())
    assert meta["block_size"] == 32 and meta["element_format"] == "e2m1"
    ckpt = consolidated_state(latest_checkpoint(run_dir / "checkpoints"))["model"]
    loaded = load_mxfp4_export(out)
    expert_names = {f"layers.{i}.ffn.experts.{w}" for i in MOE_LAYERS for w in ("w_gate", "w_up", "w_down")}
    assert set(meta["quantized"]) == expert_names
    packed = bf16 = 0
    for name in expert_names:
        w = ckpt[name]
        assert meta["quantized"][name]["block_axis"] == 1
        assert torch.equal(loaded[name], fake_quant_mx(w.transpose(1, 2), "e2m1").transpose(1, 2)), name
        packed += w.numel() // 2 + w.numel() // 32
        bf16 += w.numel() * 2
    # The loaded weights are exactly what the QAT forward multiplies by.
    model = build_model(small_cfg("precision.recipe=mxfp4_qat"))
    missing = model.load_state_dict(ckpt, strict=False).missing_keys
    assert all(k.endswith("_extra_state") for k in missing), missing  # megatron's None entries
    for i in MOE_LAYERS:
        used = model.get_submodule(f"layers.{i}.ffn.experts")._weights()
        for w, tensor in zip(("w_gate", "w_up", "w_down"), used):
            assert torch.equal(loaded[f"layers.{i}.ffn.experts.{w}"], tensor)
    for name, value in ckpt.items():
        if isinstance(value, torch.Tensor) and name not in expert_names:
            assert torch.equal(loaded[name], value.to(torch.bfloat16)), name
    assert packed < bf16 / 3
