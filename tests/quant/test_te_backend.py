"""Transformer Engine as the fp8 backend (``precision.fp8_backend=te``, k3train/quant/te_backend.py).

Without TE (CPU, CI): the config fields and their one-line refusals, the install message, and
the replacement plan on real models: the TE backend selects exactly the modules torchao's fp8
converts, and each one's weight lives under the checkpoint key and shape the bf16 model saves.
With TE on a CUDA GPU (``scripts/gpu_check_te.py`` runs these): the replaced model's state
dict equals the bf16 model's key for key and tensor for tensor, a bf16 checkpoint loads strictly
into it and its own loads strictly into bf16, and its loss matches bf16's to float8 rounding
under each recipe the GPU runs.
"""
import importlib.util

import pytest
import torch

from k3train.config import load_config
from k3train.errors import ConfigError, UsageError
from k3train.model.model import build_model
from k3train.quant import te_backend
from k3train.quant.recipes import DEFAULT_SCOPES, _apply_fp8, apply_precision, fp8_linear_config, select_scope, te_targets

from tests.helpers import SMALL

# SMALL with every projection width a multiple of 16 (fp8 GEMMs need it), as test_fp8_linears.
DIMS = [*SMALL, "model.mla.qk_rope_head_dim=16", "train.device=cpu"]
TE_FOUND = importlib.util.find_spec("transformer_engine") is not None


def _model(*extra):
    torch.manual_seed(0)
    return build_model(load_config("configs/k3_tiny.yaml", [*DIMS, *extra]))


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_te_recipes_need_the_te_backend(recipe):
    cfg = load_config("configs/k3_tiny.yaml", ["precision.fp8_backend=te", f"precision.fp8_recipe={recipe}"])
    assert (cfg.precision.fp8_backend, cfg.precision.fp8_recipe) == ("te", recipe)
    with pytest.raises(ConfigError, match=rf"fp8_recipe={recipe} needs precision.fp8_backend=te.*allowed with torchao: current"):
        load_config("configs/k3_tiny.yaml", [f"precision.fp8_recipe={recipe}"])


def test_unknown_backend_and_recipe_are_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"precision.fp8_backend: Input should be 'torchao' or 'te'"):
        load_config("configs/k3_tiny.yaml", ["precision.fp8_backend=apex"])
    with pytest.raises(ConfigError, match=r"precision.fp8_recipe: Input should be 'current', 'delayed' or 'blockwise'"):
        load_config("configs/k3_tiny.yaml", ["precision.fp8_backend=te", "precision.fp8_recipe=mxfp8"])


def test_delayed_scaling_with_recompute_is_refused():
    te_delayed = ["precision.recipe=fp8", "precision.fp8_backend=te", "precision.fp8_recipe=delayed"]
    with pytest.raises(ConfigError, match=r"fp8_recipe=delayed .* train.recompute=selective; use fp8_recipe current"):
        load_config("configs/k3_tiny.yaml", [*te_delayed, "train.recompute=selective"])
    for ok in (["train.recompute=none"], ["train.recompute=full", "precision.fp8_recipe=current"]):
        load_config("configs/k3_tiny.yaml", [*te_delayed, *ok])


def test_te_backend_rules_out_cuda_graphs():
    cfg = load_config("configs/k3_tiny.yaml", ["precision.recipe=fp8", "precision.fp8_backend=te",
                                               "train.device=cuda", "data.document_mask=false"])
    assert list(cfg.cuda_graph_blockers(device="cuda")) == ["precision.fp8_backend"]
    with pytest.raises(ConfigError, match=r"not validated with Transformer Engine"):
        load_config("configs/k3_tiny.yaml", ["precision.recipe=fp8", "precision.fp8_backend=te",
                                             "train.device=cuda", "data.document_mask=false", "train.cuda_graph=true"])


@pytest.mark.skipif(TE_FOUND, reason="Transformer Engine is installed here: the message for its absence cannot be seen")
def test_missing_transformer_engine_is_one_line_naming_the_install():
    for call in (te_backend.import_te, lambda: te_backend.check_te("current"), lambda: te_backend.te_recipe("delayed")):
        with pytest.raises(UsageError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and 'pip install -e ".[te]"' in msg and "precision.fp8_backend=te" in msg


def test_te_selects_the_modules_torchao_converts(world1):
    """The plan against torchao's own conversion (CPU emulation) of the same default scope."""
    torchao = pytest.importorskip("torchao.float8")  # noqa: F841 - in the dev extra

    for extra in ([], ["model.mla.qk_rope_head_dim=8"]):   # the second has an unfit kv_down (40 wide)
        model = _model(*extra)
        targets = select_scope(model, DEFAULT_SCOPES["fp8"])
        plan = te_targets(model, targets, skip_unfit=True)
        converted = _apply_fp8(_model(*extra), targets, config=fp8_linear_config(emulate=True), skip_unfit=True)
        # The routed experts take the fp8 grouped GEMM under either backend: not TE's linears.
        assert list(plan) == [n for n in converted if not n.endswith(".ffn.experts")] and len(plan) >= 14
    assert "layers.3.mixer.kv_down" not in plan and "layers.3.mixer.kv_down" in targets


def test_te_weights_keep_their_checkpoint_keys_and_shapes(world1):
    """Every replaced module's weight is saved under the bf16 model's key with its shape: a
    tensor-parallel linear's under ``.inner.weight`` (TELinear becomes its inner), an
    ``nn.Linear``'s under ``.weight``; and those are all the in-scope weights."""
    model = _model()
    state = model.state_dict()
    targets = select_scope(model, DEFAULT_SCOPES["fp8"])
    plan = te_targets(model, targets)
    assert plan["layers.0.mixer.q_proj"] == "layers.0.mixer.q_proj.inner.weight"
    assert plan["layers.1.ffn.down"] == "layers.1.ffn.down.weight"
    modules = dict(model.named_modules())
    for name, key in plan.items():
        assert state[key].shape == modules[name].weight.shape and state[key].data_ptr() == modules[name].weight.data_ptr()
    # The routed experts are in fp8's scope but not TE's (the grouped GEMM hook under either backend).
    in_scope = {k for k in state for n in targets if k.startswith(n + ".") and not n.endswith(".ffn.experts")}
    # megatron-core's linears also save an ``_extra_state`` entry, always None: TEInnerLinear
    # keeps it (the GPU test below compares the whole state dicts).
    extra = {k for k in in_scope if k.endswith("._extra_state")}
    assert set(plan.values()) == in_scope - extra
    assert extra == {k.replace(".weight", "._extra_state") for k in plan.values() if ".inner." in k}
    assert all(state[k] is None for k in extra)


def test_te_refuses_an_unfit_linear_an_explicit_scope_names(world1):
    model = _model("model.mla.qk_rope_head_dim=8")
    with pytest.raises(UsageError, match=r"fp8 GEMMs need both dims of layers.3.mixer.kv_down to be multiples of 16; got 64x40"):
        te_targets(model, select_scope(model, [r"\.mixer\.kv_down$"]))


# ---- on a CUDA GPU with Transformer Engine (scripts/gpu_check_te.py installs and runs these) ----

def _te_gpu():
    pytest.importorskip("transformer_engine.pytorch", reason="needs Transformer Engine (pip install -e \".[te]\"), CUDA only")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _gpu_cfg(*extra):
    return load_config("configs/k3_tiny.yaml", [*SMALL, "model.mla.qk_rope_head_dim=16", "train.device=cuda", *extra])


def _gpu_model(*extra):
    torch.manual_seed(0)
    return build_model(_gpu_cfg(*extra)).cuda()


@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise"])
def test_te_model_state_dict_is_the_bf16_one_and_loss_matches(recipe, world1):
    _te_gpu()
    try:
        te_backend.check_te(recipe)
    except UsageError as exc:
        pytest.skip(str(exc))
    bf16 = _gpu_model()
    te_args = ["precision.recipe=fp8", "precision.fp8_backend=te", f"precision.fp8_recipe={recipe}"]
    te, te_cfg = _gpu_model(*te_args), _gpu_cfg(*te_args)
    TELinear = te_backend.te_linear_class()   # TEInnerLinear, in the TP linears, subclasses it
    assert sum(isinstance(m, TELinear) for m in te.modules()) == len(te.quantized) >= 14
    ref, got = bf16.state_dict(), te.state_dict()
    assert list(got) == list(ref)   # no _extra_state, nothing renamed
    # Idempotent: the TE linears are scope leaves as the nn.Linear modules were, their TP
    # wrappers' TE inners are not.
    assert apply_precision(te, te_cfg.precision, "cuda") == te.quantized
    assert list(te.state_dict()) == list(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    te.load_state_dict(ref, strict=True)
    bf16.load_state_dict(got, strict=True)
    tokens = torch.randint(0, 320, (4, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = {}
    for name, model in (("bf16", bf16), ("te", te)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses[name] = loss.item()
    # float8 rounding of ~16 GEMMs at init: measured well under 1% of the loss.
    assert losses["te"] == pytest.approx(losses["bf16"], rel=2e-2)
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(te.named_parameters(), bf16.parameters())]
    assert all((a is None) == (b is None) for _, a, b in pairs)
    pairs = [(n, a.flatten().double(), b.flatten().double()) for n, a, b in pairs if a is not None]
    assert all(torch.isfinite(a).all() for _, a, _ in pairs)
    cos = torch.nn.functional.cosine_similarity
    # float8 rounding in the forward and both backward GEMMs: the gradient direction holds.
    assert cos(torch.cat([a for _, a, _ in pairs]), torch.cat([b for _, _, b in pairs]), dim=0) > 0.99
    for n, a, b in pairs:
        if a.numel() >= 4096:
            assert cos(a, b, dim=0) > 0.9, n


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_te_recompute_runs_the_same_float8_forward(recipe, world1):
    """Under ``train.recompute=full`` the recomputed forward runs in backward, outside the
    chunk's TE region: each TE linear enters a region of its own (te_backend.TELinear), so the
    gradients are those of the forward that ran (stateless recipes: the same scales again)."""
    _te_gpu()
    try:
        te_backend.check_te(recipe)
    except UsageError as exc:
        pytest.skip(str(exc))
    te = ["precision.recipe=fp8", "precision.fp8_backend=te", f"precision.fp8_recipe={recipe}"]
    tokens = torch.randint(0, 320, (4, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    grads, losses = [], []
    for mode in ("none", "full"):
        model = _gpu_model(*te, f"train.recompute={mode}")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
    assert losses[0] == losses[1]
    # Same float8 products; only the order of some bf16 reductions may differ.
    assert ((grads[0] - grads[1]).norm() / grads[0].norm()).item() < 1e-2
