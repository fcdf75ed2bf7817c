"""``k3train eval --by-position``: the loss by position in the window.

Reference, independent of the bucketed forward: a causal model's loss at position t is the loss
of the last position when the model runs on the first t+1 tokens alone, so each window is cut
into prefixes and each prefix run separately (one forward per position, fp32 on CPU). The bucket
means from those equal the command's to 1e-5, and the buckets' token-weighted mean equals the
plain eval loss."""
import pytest
import torch
import torch.nn.functional as F

from k3train.cli import main as cli_main
from k3train.config import load_config
from k3train.model.model import build_model
from k3train.trainer.data import build_data
from k3train.trainer.evaluate import evaluate_checkpoint
from k3train.trainer.loop import train
from k3train.trainer.position_loss import position_buckets
from k3train.trainer.state_io import consolidated_state
from tests.helpers import small_cfg

SEQ = 12


def test_buckets_double_and_cover_the_window():
    assert position_buckets(1) == [(0, 1)]
    assert position_buckets(5) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    for n in (2, 7, 64, 100):
        b = position_buckets(n)
        assert b[0][0] == 0 and b[-1][1] == n and all(x[1] == y[0] for x, y in zip(b, b[1:]))


@pytest.mark.slow  # trains 2 steps of a tiny model, then one forward per position
def test_by_position_equals_prefix_runs(tmp_path, capsys, world1):
    run = tmp_path / "run"
    overrides = ["train.steps=2", "data.document_mask=false", "train.cuda_graph=false", "train.device=cpu"]
    train(small_cfg(*overrides), run)
    got = evaluate_checkpoint(run, batches=2, seq_len=SEQ, by_position=True, progress=False)
    plain = evaluate_checkpoint(run, batches=2, seq_len=SEQ, progress=False)
    rows = got["by_position"]
    assert [(r["from"], r["to"]) for r in rows] == position_buckets(SEQ)
    mean = sum(r["loss"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows)
    assert mean == pytest.approx(plain["loss"], rel=1e-5) and got["loss"] == pytest.approx(plain["loss"], rel=1e-5)

    cfg = load_config(run / "config.yaml", [f"train.seq_len={SEQ}"])
    model = build_model(cfg)
    model.load_state_dict(consolidated_state(run / "checkpoints" / "step_00000002", optimizer=False)["model"])
    model.eval()
    batches = build_data(cfg).val[:2]
    sums = torch.zeros(SEQ, dtype=torch.float64)
    with torch.no_grad():
        for b in batches:
            for t in range(SEQ):
                logits = model(b[:, :t + 1])[:, -1]
                sums[t] += F.cross_entropy(logits.float(), b[:, t + 1], reduction="sum").double()
    count = sum(b.shape[0] for b in batches)
    for r in rows:
        want = float(sums[r["from"]:r["to"]].sum() / (count * (r["to"] - r["from"])))
        assert r["tokens"] == count * (r["to"] - r["from"])
        assert r["loss"] == pytest.approx(want, rel=1e-5), r

    plot = tmp_path / "pos.png"
    assert cli_main(["eval", "--checkpoint", str(run), "--batches", "2", "--seq-len", str(SEQ), "--by-position",
                     "--plot", str(plot), "logging.progress_bar=false"]) == 0
    out = capsys.readouterr().out
    assert "loss by position in the window:" in out and plot.stat().st_size > 1000
    assert f"{rows[-1]['loss']:.4f}" in out
    # an existing file is not replaced
    assert cli_main(["eval", "--checkpoint", str(run), "--batches", "1", "--by-position", "--plot", str(plot)]) == 2
    assert "--plot" in capsys.readouterr().err
