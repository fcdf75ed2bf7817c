"""A seeded sweep's figures against its tables: one line per variant through the means over
seeds, a band over the seeds' range, the MaxVio curve ending on results.md's column; the
footnote names only columns that exist; the command line's overrides are recorded; throughput
measured on a CPU is labelled and left out of the table over seeds; a progress line per variant."""
import csv
import json
from pathlib import Path

import pytest
import yaml

import k3train.sweep.plots as sweep_plots
import k3train.trainer.loop as loop
from k3train.sweep.plots import BAND
from k3train.sweep.progress import VariantProgress
from k3train.sweep.runner import run_sweep

SEEDS = (1, 2, 4)


def _ablation(tmp_path):
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump({"name": "unit", "base": str(Path("configs/k3_tiny.yaml").resolve()),
                                    "overrides": ["train.steps=4", "logging.progress_bar=false"],
                                    "grid": {"optim.name": ["adamw", "muon"]}}))
    return path


def _values(name: str, seed: int, step: int) -> dict:
    """A metrics record whose values differ by variant, seed and step (so means and ranges are known)."""
    base = 2.0 if "adamw" in name else 3.0
    return {"step": step, "loss": base + 0.1 * seed + 1.0 / step, "tokens_per_s": 100.0 * seed + step,
            "moe/maxvio": 9.0,  # the per-step value: not what the table reports
            "moe/maxvio_running": 0.05 * seed ** 2 + base / step,
            **({"val_loss": base + 0.01 * seed ** 2 + 1.0 / step} if step % 2 == 0 else {})}


def _fake_train(device: str):
    def fake_train(cfg, run_dir, resume=False):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "kernels.json").write_text(json.dumps({"device": device}))
        recs = [_values(run_dir.name, cfg.train.seed, s) for s in range(1, cfg.train.steps + 1)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        print("[k3train] done")
        return {"steps": cfg.train.steps}
    return fake_train


def _capture_figures(monkeypatch) -> dict[str, object]:
    """file name -> the figure sweep_plots saved there (its lines and bands read before closing)."""
    figures = {}
    save = sweep_plots._save

    def keep(fig, path):
        figures[Path(path).name] = [
            {"title": ax.get_title(),
             "lines": {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines},
             "bands": [c.get_paths()[0].vertices.copy() for c in ax.collections],
             "legend": [t.get_text() for t in ax.get_legend().get_texts()]} for ax in fig.axes]
        return save(fig, path)

    monkeypatch.setattr(sweep_plots, "_save", keep)
    return figures


def _band_at(band, x) -> tuple[float, float]:
    ys = band[band[:, 0] == x][:, 1]
    return float(ys.min()), float(ys.max())


def test_seeded_plots_draw_the_tables_means_and_the_seeds_range(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "train", _fake_train("cpu"))
    figures = _capture_figures(monkeypatch)
    out = tmp_path / "out"
    rows = run_sweep(_ablation(tmp_path), out, ["optim.lr=1e-3"], seeds=",".join(map(str, SEEDS)))
    per_run = {r["variant"]: r for r in rows}
    over_seeds = {r["variant"]: r for r in csv.DictReader(open(out / "results_seeds.csv"))}
    assert set(over_seeds) == {"name-adamw", "name-muon"}

    (train_ax, val_ax), (maxvio_ax,) = figures["loss_curves.png"], figures["maxvio_curves.png"]
    assert train_ax["title"] == "train loss" and val_ax["title"] == "validation loss"
    for ax, column in ((train_ax, "final_train_loss"), (val_ax, "final_val_loss"), (maxvio_ax, "maxvio_running")):
        # one line per variant (not one per seeded run), a band per variant, the band named
        assert sorted(ax["lines"]) == [f"name-{o} (mean of 3 seeds)" for o in ("adamw", "muon")]
        assert len(ax["bands"]) == 2 and BAND in ax["legend"]
        for band, (label, (xs, ys)) in zip(ax["bands"], sorted(ax["lines"].items())):
            variant = label.split()[0]
            finals = [per_run[f"{variant}_seed-{s}"][column] for s in SEEDS]
            # the line's last point is the table's mean over seeds; the band spans the seeds' finals
            assert ys[-1] == pytest.approx(float(over_seeds[variant][f"{column}_mean"]), rel=1e-12)
            assert ys[-1] == pytest.approx(sum(finals) / 3, rel=1e-12)
            assert _band_at(band, xs[-1]) == pytest.approx((min(finals), max(finals)), rel=1e-12)
        assert xs == ([2, 4] if column == "final_val_loss" else [1, 2, 3, 4])
    # the MaxVio plotted is the column's moe/maxvio_running, not the per-step moe/maxvio
    assert per_run["name-muon_seed-2"]["maxvio_running"] == pytest.approx(0.05 * 4 + 3.0 / 4)
    assert "maxvio_running" in maxvio_ax["title"]

    md = (out / "results.md").read_text()
    footnote = next(line for line in md.splitlines() if line.startswith("tokens: "))
    assert "recall_acc" not in md and "maxvio_running: last logged moe/maxvio_running" in footnote
    # the sweep's own overrides and seeds are recorded
    assert "command-line overrides: `optim.lr=1e-3`" in md and "seeds: 1, 2, 4 (from --seeds)" in md
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["command_line_overrides"] == ["optim.lr=1e-3"] and manifest["seeds"] == list(SEEDS)
    assert manifest["file_overrides"] == ["train.steps=4", "logging.progress_bar=false"]
    # CPU throughput: labelled in the per-run table, left out of the table over seeds
    assert "| tokens_per_s (CPU, indicative) |" in md and "not averaged over seeds" in footnote
    seeds_md = md[md.index("## Over seeds"):]
    assert "tokens_per_s" not in seeds_md.splitlines()[2] and "tokens_per_s_mean" not in over_seeds["name-adamw"]
    assert [r["device"] for r in csv.DictReader(open(out / "results.csv"))] == ["cpu"] * 6
    # a progress line per variant while it trains, and no resume chatter for fresh variants
    printed = capsys.readouterr().out
    assert "[sweep] name-muon_seed-4: step 4/4 (100%), loss 3.6500, val 3.4100" in printed
    assert "nothing to resume" not in printed


def test_gpu_throughput_keeps_its_mean_and_spread(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "train", _fake_train("cuda"))
    out = tmp_path / "out"
    run_sweep(_ablation(tmp_path), out, seeds="1,2")
    md = (out / "results.md").read_text()
    assert "CPU, indicative" not in md and "command-line overrides: none" in md
    table = {r["variant"]: r for r in csv.DictReader(open(out / "results_seeds.csv"))}
    speeds = [sum(100.0 * s + step for step in range(1, 5)) / 4 for s in (1, 2)]
    assert float(table["name-adamw"]["tokens_per_s_mean"]) == pytest.approx(sum(speeds) / 2, rel=1e-12)


def test_an_unseeded_sweep_draws_one_line_per_run_ending_on_its_row(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "train", _fake_train("cpu"))
    figures = _capture_figures(monkeypatch)
    rows = {r["variant"]: r for r in run_sweep(_ablation(tmp_path), tmp_path / "out")}
    (maxvio_ax,) = figures["maxvio_curves.png"]
    assert not maxvio_ax["bands"] and BAND not in maxvio_ax["legend"]
    assert {k: v[1][-1] for k, v in maxvio_ax["lines"].items()} == {
        name: row["maxvio_running"] for name, row in rows.items()}


def test_progress_lines_every_tenth_of_the_run_at_validations_and_the_end(tmp_path):
    progress = VariantProgress("v", tmp_path, steps=60)
    metrics = tmp_path / "metrics.jsonl"
    printed = []
    with open(metrics, "w") as f:
        for step in range(5, 61, 5):  # logged every 5 steps, validated every 20
            f.write(json.dumps({"step": step, "loss": 1.0, **({"val_loss": 2.0} if step % 20 == 0 else {})}) + "\n")
            f.flush()
            printed += progress.poll()
    assert [int(line.split("step ")[1].split("/")[0]) for line in printed] == [10, 20, 30, 40, 50, 60]
    assert printed[1].startswith("[sweep] v: step 20/60 (33%), loss 1.0000, val 2.0000, ")
    assert "left" in printed[0] and "left" not in printed[-1]
    # a resumed variant prints only what it logs from now on
    again = VariantProgress("v", tmp_path, steps=80)
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 65, "loss": 1.0}) + "\n" + json.dumps({"step": 70, "loss": 1.0}) + "\n")
    assert [line.split(",")[0] for line in again.poll()] == ["[sweep] v: step 70/80 (87%)"]


@pytest.mark.slow
def test_a_real_seeded_sweep_plots_its_table(tmp_path, monkeypatch, capsys):
    """Real training (two seeds of one variant): the figure's mean line ends on the table's mean."""
    from tests.helpers import SMALL

    figures = _capture_figures(monkeypatch)
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump({"name": "real", "base": str(Path("configs/k3_tiny.yaml").resolve()),
                                    "overrides": [*SMALL, "train.steps=3", "train.log_interval=1",
                                                  "train.eval_interval=3"],
                                    "variants": [{"name": "base", "overrides": []}]}))
    out = tmp_path / "out"
    rows = run_sweep(path, out, seeds="1,2")
    assert [r["variant"] for r in rows] == ["base_seed-1", "base_seed-2"]
    assert rows[0]["final_val_loss"] != rows[1]["final_val_loss"]  # the seeds differ
    mean = float(next(csv.DictReader(open(out / "results_seeds.csv")))["final_val_loss_mean"])
    (_, val_ax) = figures["loss_curves.png"]
    (label, (xs, ys)), = val_ax["lines"].items()
    assert label == "base (mean of 2 seeds)" and xs == [3] and ys[-1] == pytest.approx(mean, rel=1e-12)
    assert _band_at(val_ax["bands"][0], 3) == pytest.approx(
        sorted(r["final_val_loss"] for r in rows), rel=1e-12)
    printed = capsys.readouterr().out
    assert "[sweep] base_seed-2: step 3/3 (100%)" in printed and "nothing to resume" not in printed
