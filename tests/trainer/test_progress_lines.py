"""What a run prints besides the progress bar: each evaluation's val loss gets its own line,
equal to the value metrics.jsonl records (the last one is in the closing ``done:`` line)."""
import re

from k3train.trainer.loop import train
from pipeline import CommRecorder
from pipeline.trace import gantt_title
from tests.helpers import read_records, small_cfg


def test_every_evaluation_but_the_last_prints_its_val_loss(tmp_path, capsys, world1):
    run = tmp_path / "run"
    train(small_cfg("train.steps=4", "train.eval_interval=2", "train.log_interval=1",
                    "train.device=cpu", "train.cuda_graph=false"), run)
    out = capsys.readouterr().out
    printed = {int(s): float(v) for s, v in re.findall(r"\[k3train\] step (\d+): val loss ([0-9.]+)", out)}
    logged = {r["step"]: r["val_loss"] for r in read_records(run) if "val_loss" in r}
    assert sorted(logged) == [2, 4] and sorted(printed) == [2]
    assert abs(printed[2] - logged[2]) < 5e-5
    done = [line for line in out.splitlines() if line.startswith("[k3train] done:")]
    assert len(done) == 1 and f"val loss {logged[4]:.4f}" in done[0]


def test_gantt_title_names_the_layout():
    rec = CommRecorder()
    rec.info = {"pp_size": 2, "vpp_size": 2, "num_microbatches": 8}
    assert gantt_title(rec, 2).startswith("pipeline step timeline, 2 ranks (P 2, V 2, m 8)")
    assert "(" not in gantt_title(CommRecorder(), 1)
