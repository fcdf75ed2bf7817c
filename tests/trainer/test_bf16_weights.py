"""The trainer under bf16 weights (``precision.param_dtype=bf16``) and bf16 moments
(``optim.state_dtype=bf16``): docs/memory.md#layouts.

(d) A checkpoint stores the fp32 main values under the weights' names: saved under bf16
    weights it resumes under fp32 weights, and the reverse, with the main parameters (the fp32
    weights, or the bf16 run's fp32 main parameters) equal to the stored values bit for bit and
    the bf16 weights equal to them rounded.
    ``train.init_from`` sets the main parameters from the checkpoint's values as well.
(e) With bf16 weights and bf16 moments the tiny model still learns: its loss after 20 steps is
    within 0.1 nats of the fp32 run's (both start near ln(320) = 5.77 and fall by more than 1.0),
    and its moments are bf16 in memory.
Distributed (gloo): ZeRO-1 with EP=2, replicated with PP=2 x DP=2, and ZeRO-1 with bf16 moments
follow the one-process run of the same layout of the model states (losses within rel 2e-3).
"""
from __future__ import annotations

import pytest
import torch

from k3train.config import ConfigError
from k3train.runtime.distributed import shutdown_distributed
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.loop import Trainer, train
from k3train.trainer.optim_state import main_param_values
from k3train.trainer.reshard import global_names
from k3train.trainer.state_io import consolidated_state
from tests.distributed.helpers import STEPS, read_losses, train_rank
from tests.helpers import read_records, small_cfg
from tests.multiproc import run_multiprocess

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _main_values(state) -> dict[str, torch.Tensor]:
    """{global name: the fp32 value the optimizer steps}: its main parameters, else the weights."""
    names = global_names(state.model)
    mains = main_param_values(state.optimizer)
    return {names[n]: mains.get(id(p), p.detach()) for n, p in state.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("bf16", "fp32"), ("fp32", "bf16")])
def test_checkpoint_resumes_across_weight_dtypes_with_equal_main_values(tmp_path, saved, resumed):
    common = ["train.log_interval=1", "optim.name=muon", "optim.zero1=true", "train.microbatches=2"]
    train(small_cfg("train.steps=3", f"precision.param_dtype={saved}", *common), tmp_path)
    stored = consolidated_state(latest_checkpoint(tmp_path / "checkpoints"))["model"]
    trainer = Trainer(small_cfg("train.steps=4", f"precision.param_dtype={resumed}", *common), tmp_path,
                      resume=True)
    trainer.set_up()
    state = trainer.state
    params = dict(state.model.named_parameters())
    assert {p.dtype for p in params.values()} == {DTYPES[resumed]}
    names = global_names(state.model)
    mains = _main_values(state)
    for local, p in params.items():
        want = stored[names[local]]
        assert want.dtype == torch.float32, local
        assert torch.equal(mains[names[local]], want), local
        assert torch.equal(p.detach(), want.to(p.dtype)), local
    if saved == "bf16":  # the fp32 main values were stored, not the rounded bf16 weights
        assert any(not torch.equal(t, t.bfloat16().float()) for t in stored.values())
    trainer.run_loop()   # step 4 trains on the loaded state
    trainer.end_of_run()
    assert torch.isfinite(torch.tensor(read_records(tmp_path)[-1]["loss"]))
    shutdown_distributed()


def test_bf16_weights_and_moments_learn_like_fp32(tmp_path):
    extra = ["train.steps=20", "train.log_interval=5", "optim.warmup_steps=5", "optim.name=muon"]
    train(small_cfg(*extra), tmp_path / "fp32")
    shutdown_distributed()
    trainer = Trainer(small_cfg(*extra, "precision.param_dtype=bf16", "optim.state_dtype=bf16"),
                      tmp_path / "bf16")
    trainer.run()
    opt = trainer.state.optimizer
    moments = [v for inner in opt.optimizers for st in inner.state.values() for k, v in st.items() if k != "step"]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}
    assert {p.dtype for p in trainer.state.params} == {torch.bfloat16}
    fp32, bf16 = (read_records(tmp_path / d) for d in ("fp32", "bf16"))
    assert fp32[0]["loss"] > 5.0 and bf16[0]["loss"] > 5.0
    for runs in (fp32, bf16):
        assert runs[-1]["loss"] < runs[0]["loss"] - 1.0
    assert abs(fp32[-1]["loss"] - bf16[-1]["loss"]) < 0.1, (fp32[-1]["loss"], bf16[-1]["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("overrides, world", [
    (["optim.zero1=true", "optim.name=muon", "parallel.ep=2"], 2),
    (["optim.zero1=false", "optim.name=muon", "parallel.pp=2", "train.microbatches=2"], 4),
    (["optim.zero1=true", "optim.name=muon", "optim.state_dtype=bf16"], 2),
], ids=["zero1-ep2-dp2-muon", "replicated-pp2-dp2-muon", "zero1-dp2-muon-bf16-moments"])
def test_bf16_weights_distributed_training_matches_single_process(tmp_path, overrides, world):
    """gloo ranks with bf16 weights follow the one-process bf16 run: losses within rel 2e-3 (the
    fp32 main parameters agree to fp32 rounding; a weight then rounds to bf16 either way)."""
    bf16 = ["precision.param_dtype=bf16"]
    ref_base = [o for o in overrides if o.startswith(("train.", "optim.")) and o != "optim.zero1=true"]
    train(small_cfg(*STEPS, *ref_base, *bf16, "train.micro_batch_size=8"), tmp_path / "ref")
    run_multiprocess(train_rank, world, tmp_path / "dist", [*overrides, *bf16])
    ref, got = read_losses(tmp_path / "ref"), read_losses(tmp_path / "dist")
    assert got == pytest.approx(ref, rel=2e-3), (got, ref)


def test_bf16_weights_are_refused_with_the_fp32_recipe_and_cuda_graphs():
    with pytest.raises(ConfigError, match="param_dtype=bf16 with precision.recipe=fp32"):
        small_cfg("precision.param_dtype=bf16", "precision.recipe=fp32")
    with pytest.raises(ConfigError, match="cannot capture precision.param_dtype=bf16"):
        small_cfg("precision.param_dtype=bf16", "train.cuda_graph=true", "train.device=cuda",
                  "data.document_mask=false")
    assert "precision.param_dtype" in small_cfg("precision.param_dtype=bf16").cuda_graph_blockers(device="cuda")
    assert "precision.param_dtype" not in small_cfg().cuda_graph_blockers(device="cuda")


def test_init_from_sets_the_main_parameters_of_bf16_weights(tmp_path):
    """``train.init_from`` copies a checkpoint's values into the fp32 main parameters too (not only
    into the bf16 weights, whose rounding the first step would otherwise make permanent)."""
    train(small_cfg("train.steps=2"), tmp_path / "src")
    stored = consolidated_state(latest_checkpoint(tmp_path / "src" / "checkpoints"))["model"]
    shutdown_distributed()
    trainer = Trainer(small_cfg("train.steps=2", "precision.param_dtype=bf16",
                                f"train.init_from={tmp_path / 'src'}"), tmp_path / "dst")
    trainer.set_up()
    names = global_names(trainer.state.model)
    mains = _main_values(trainer.state)
    assert mains and all(torch.equal(v, stored[g]) for g, v in mains.items())
    assert any(not torch.equal(v, v.bfloat16().float()) for v in mains.values())
    for local, p in trainer.state.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), stored[names[local]].bfloat16()), local
