"""A resumed run keeps the data.document_mask its config.yaml recorded, and a config.yaml from
before the key resumes with document masking off (what that run trained with)."""
from __future__ import annotations

import pytest
import yaml

from k3train.config import dump_config, load_config
from k3train.trainer.loop import train
from k3train.trainer.run_dir import keep_recorded_settings
from tests.helpers import read_records, small_cfg


def _record(run_dir, cfg, drop_key=False):
    tree = yaml.safe_load(dump_config(cfg))
    if drop_key:
        del tree["data"]["document_mask"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(tree))


@pytest.mark.parametrize("recorded, drop_key, given, want", [
    (True, True, True, False),      # a config.yaml from before the key: the old behaviour
    (True, False, False, True),     # recorded on: stays on whatever the given config says
    (False, False, True, False),    # recorded off: stays off under the new default
    (True, False, True, True),
])
def test_the_recorded_value_wins(tmp_path, recorded, drop_key, given, want):
    _record(tmp_path, load_config(None, [f"data.document_mask={recorded}"]), drop_key)
    lines = []
    cfg = keep_recorded_settings(load_config(None, [f"data.document_mask={given}", "train.steps=7"]),
                                 tmp_path, lines.append)
    assert cfg.data.document_mask is want and cfg.train.steps == 7   # nothing else changes
    assert len(lines) == (want != given)
    if lines:
        assert lines[0].startswith(f"[k3train] --resume: data.document_mask={want} as ")


def test_no_recorded_config_keeps_the_given_one(tmp_path):
    cfg = load_config(None, ["data.document_mask=false"])
    assert keep_recorded_settings(cfg, tmp_path, print) is cfg


@pytest.mark.slow  # trains a tiny model three times (about 30-60 s on two shared cores)
def test_an_old_run_resumes_unmasked_to_the_same_losses(tmp_path):
    args = ["train.steps=4", "checkpoint.interval=2", "train.log_interval=1"]
    ref = tmp_path / "ref"
    train(small_cfg(*args, "data.document_mask=false"), ref)
    run = tmp_path / "run"
    train(small_cfg(*args, "data.document_mask=false"), run, stop_at=2)
    _record(run, small_cfg(*args, "data.document_mask=false"), drop_key=True)   # as written before the key
    train(small_cfg(*args), run, resume=True)     # the new default (true) is not applied
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["document_mask"] is False
    assert {r["step"]: r["loss"] for r in read_records(run)}[4] == read_records(ref)[-1]["loss"]
