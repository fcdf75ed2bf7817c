"""One way into a checkpoint (``k3train.trainer.restore``): a checkpoint written by two gloo
ranks at PP=2 opens in one process for eval, generate and both exporters with no layout
override, and a run directory, its checkpoints/ directory and its step directory name the
same checkpoint.

The reference is independent of restore.py: the checkpoint's pieces assembled by
``consolidated_state`` into a plain one-process ``build_model``, and its validation loss
computed here batch by batch (fp32 on CPU)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from k3train.cli import main as cli_main
from k3train.config import load_config
from k3train.errors import CheckpointError
from k3train.hf.load import load_hf
from k3train.model.model import build_model
from k3train.quant.export import load_mxfp4_export
from k3train.runtime.distributed import init_distributed, shutdown_distributed
from k3train.trainer.data import build_data
from k3train.trainer.evaluate import evaluate_checkpoint
from k3train.trainer.export import export_hf_checkpoint, export_mxfp4
from k3train.trainer.loop import train
from k3train.trainer.restore import load_model, resolve_checkpoint, run_config
from k3train.trainer.state_io import consolidated_state
from tests.multiproc import run_multiprocess
from tests.helpers import small_cfg

PP2 = ["parallel.pp=2", "train.microbatches=2", "train.steps=2", "train.log_interval=1",
       "train.eval_interval=100", "checkpoint.interval=2"]


def _train_rank(rank, world_size, run_dir):
    train(small_cfg(*PP2), run_dir)


def test_a_run_checkpoints_and_step_directory_name_the_same_checkpoint(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    for step in (1, 2):
        (ckpts / f"step_{step:08d}").mkdir(parents=True)
        (ckpts / f"step_{step:08d}" / "manifest.json").write_text("{}")
    (ckpts / "latest").write_text("step_00000001")
    want = ckpts / "step_00000001"  # 'latest', not the newest name
    assert resolve_checkpoint(run) == resolve_checkpoint(ckpts) == resolve_checkpoint(want) == want
    assert resolve_checkpoint(ckpts / "step_00000002") == ckpts / "step_00000002"
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_one_process_layout_is_the_default_and_overrides_still_apply(tmp_path):
    from k3train.trainer.run_dir import save_config

    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    save_config(small_cfg("parallel.pp=2", "parallel.vpp=2", "parallel.ep=2", "train.microbatches=2"), tmp_path / "run" / "config.yaml")
    one, _ = run_config(step, one_process=True)
    assert (one.parallel.tp, one.parallel.pp, one.parallel.vpp, one.parallel.ep) == (1, 1, 1, 1)
    kept, _ = run_config(step, one_process=False)
    assert (kept.parallel.pp, kept.parallel.vpp, kept.parallel.ep) == (2, 2, 2)
    asked, _ = run_config(step, overrides=["parallel.tp=2"], one_process=True)
    assert asked.parallel.tp == 2  # the user's override comes after the one-process default


def _reference(cfg, weights):
    """(one-process model with ``weights``, its mean validation loss over the first 2 batches)."""
    init_distributed()
    try:
        model = build_model(cfg)
        missing = model.load_state_dict(weights, strict=False).missing_keys
        assert all(k.endswith("_extra_state") for k in missing)
        model.eval()
        val = build_data(cfg).val[:2]
        with torch.no_grad():
            loss = torch.stack([model(b[:, :-1], b[:, 1:]).float() for b in val]).mean().item()
    finally:
        shutdown_distributed()
    return model, loss


@pytest.mark.slow
def test_a_pipeline_parallel_checkpoint_opens_in_one_process(tmp_path, capsys):
    run = tmp_path / "run"
    run_multiprocess(_train_rank, 2, run)
    step_dir = run / "checkpoints" / "step_00000002"
    assert json.loads((step_dir / "manifest.json").read_text())["layout"]["pp"] == 2
    weights = consolidated_state(step_dir, optimizer=False)["model"]
    cfg = load_config(run / "config.yaml", ["parallel.pp=1", "train.microbatches=2"])
    reference, ref_loss = _reference(cfg, weights)

    # eval, given the run directory: no parallel.* override (it failed with "world size 1 is not
    # divisible by parallel.tp*parallel.pp = 1*2")
    got = evaluate_checkpoint(run, batches=2, progress=False)
    assert got["step"] == 2 and got["batches"] == 2
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-6)
    assert cli_main(["eval", "--checkpoint", str(run / "checkpoints"), "--batches", "2",
                     "logging.progress_bar=false"]) == 0
    assert f"loss {ref_loss:.4f}" in capsys.readouterr().out

    # generate's model, given the step directory: the reference's logits, bit for bit
    init_distributed()
    try:
        model, gen_cfg, where = load_model(step_dir, device="cpu")
        tokens = torch.randint(0, 257, (1, 24))
        with torch.no_grad():
            assert torch.equal(model(tokens), reference(tokens))
    finally:
        shutdown_distributed()
    assert where == step_dir and gen_cfg.parallel.pp == 1

    # both exporters, given the checkpoints/ directory
    hf = export_hf_checkpoint(run / "checkpoints", tmp_path / "hf", log=lambda *_: None)
    _, state = load_hf(hf)
    for name, value in weights.items():
        assert torch.equal(state[name], value), name
    mx = export_mxfp4(run / "checkpoints", tmp_path / "mx")
    meta, loaded = json.loads((mx / "export.json").read_text()), load_mxfp4_export(mx)
    assert meta["step"] == 2 and set(loaded) == {k for k, v in weights.items() if isinstance(v, torch.Tensor)}
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and name not in meta["quantized"]:
            assert torch.equal(loaded[name], value.to(torch.bfloat16) if value.is_floating_point() else value), name
    assert load_file(str(mx / "model.safetensors")).keys() >= {f"{n}.mx_codes" for n in meta["quantized"]}
