"""ISSUE44 item 2: ``--resume`` compares the checkpoint's tensors and optimizer with the config.
A tensor on one side only, or another optimizer, is refused in one line naming the difference
and the config field that accepts it (nothing on disk changes); with ``train.allow_model_change``
/ ``train.allow_optimizer_change`` the run prints what it drops, initialises or resets and goes on.

References are independent of restore.py: the checkpoint's tensors as ``consolidated_state``
assembles them, and the optimizer state the resumed run holds (``per_param_state``)."""
import pytest
import torch

from k3train.errors import CheckpointError
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.loop import Trainer, train
from k3train.trainer.optim_state import per_param_state
from k3train.trainer.reshard import global_names
from k3train.trainer.state_io import consolidated_state, optimizer_kinds
from tests.helpers import small_cfg

pytestmark = pytest.mark.slow  # each test trains a tiny model for 2 steps (a few seconds on 2 cores)

STEPS = ["train.log_interval=1", "train.eval_interval=100"]


def _snapshot(path):
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def _refused(run, *overrides):
    before = _snapshot(run)
    with pytest.raises(CheckpointError) as info:
        train(small_cfg("train.steps=4", *STEPS, *overrides), run, resume=True)
    assert _snapshot(run) == before  # config.yaml, metrics and checkpoints untouched
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_a_model_without_attnres_is_refused_then_drops_its_tensors_with_the_flag(tmp_path, capsys):
    train(small_cfg("train.steps=2", *STEPS), tmp_path)
    saved = consolidated_state(latest_checkpoint(tmp_path / "checkpoints"))["model"]
    attnres = sorted(n for n in saved if "_res." in n)
    assert len(attnres) == 9  # 4 layers x (mixer, ffn) + the final one

    msg = _refused(tmp_path, "model.attnres.enabled=false")
    assert "9 tensor(s) only in the checkpoint" in msg and "train.allow_model_change=true" in msg
    assert "only in the config" not in msg
    capsys.readouterr()

    train(small_cfg("train.steps=3", *STEPS, "model.attnres.enabled=false", "train.allow_model_change=true"),
          tmp_path, resume=True)
    out = capsys.readouterr().out
    dropped = [ln for ln in out.splitlines() if "train.allow_model_change: dropped 9" in ln]
    assert len(dropped) == 1 and all(n in dropped[0] for n in attnres)
    after = consolidated_state(latest_checkpoint(tmp_path / "checkpoints"))
    assert after["step"] == 3 and sorted(after["model"]) == sorted(n for n in saved if n not in attnres)


def test_a_model_with_new_tensors_is_refused_then_initialises_them_with_the_flag(tmp_path, capsys):
    train(small_cfg("train.steps=2", *STEPS, "model.attnres.enabled=false"), tmp_path)
    saved = consolidated_state(latest_checkpoint(tmp_path / "checkpoints"))["model"]
    msg = _refused(tmp_path)
    assert "9 tensor(s) only in the config's model" in msg and "train.allow_model_change=true" in msg
    capsys.readouterr()

    trainer = Trainer(small_cfg("train.steps=4", *STEPS, "train.allow_model_change=true"), tmp_path, resume=True)
    trainer.set_up()
    out = capsys.readouterr().out
    assert "9 tensor(s) not in the checkpoint start from their initialisation" in out
    names = global_names(trainer.state.model)
    now = {names[k]: v for k, v in trainer.state.model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert sorted(set(now) - set(saved)) == sorted(n for n in now if "_res." in n)
    for name, value in saved.items():  # everything the checkpoint holds is resumed bit for bit
        assert torch.equal(now[name], value), name


def test_another_optimizer_is_refused_then_reset_with_the_flag(tmp_path, capsys):
    train(small_cfg("train.steps=2", *STEPS, "optim.name=adamw"), tmp_path)
    saved = consolidated_state(latest_checkpoint(tmp_path / "checkpoints"))
    msg = _refused(tmp_path, "optim.name=muon")
    assert "optim.name adamw in the checkpoint, muon in this config" in msg
    assert "adamw -> muon" in msg and "train.allow_optimizer_change=true" in msg
    capsys.readouterr()

    cfg = small_cfg("train.steps=4", *STEPS, "optim.name=muon", "train.allow_optimizer_change=true")
    trainer = Trainer(cfg, tmp_path, resume=True)
    trainer.set_up()
    out = capsys.readouterr().out
    kinds = optimizer_kinds(trainer.state.model, trainer.state.optimizer)
    muon = sorted(n for n, k in kinds.items() if k == "muon")
    assert muon and f"optimizer state reset (fresh) for {len(muon)} parameter(s)" in out
    names = {id(p): global_names(trainer.state.model)[n] for n, p in trainer.state.model.named_parameters()}
    state, _ = per_param_state(trainer.state.optimizer)
    by_name = {names[i]: s for i, s in state.items()}
    for name in muon:  # Muon's momentum starts at zero: no state before the first step
        assert name not in by_name
    adamw = [n for n, k in kinds.items() if k == "adamw"]
    for name in adamw:  # AdamW's moments continue from the checkpoint, bit for bit
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(by_name[name][key], saved["optim"][name][key]), (name, key)
