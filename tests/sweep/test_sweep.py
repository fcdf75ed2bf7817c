"""``k3train sweep``: a two-variant grid runs, tabulates and plots; a rerun skips finished
variants; an unfinished variant resumes; the shipped ablation files resolve."""
import csv
import shutil
from pathlib import Path

import pytest
import yaml

import k3train.trainer.loop as loop
from k3train.cli import main as cli_main
from k3train.config import ConfigError
from k3train.sweep.runner import expand_seeds, load_sweep, run_sweep, variant_config
from tests.helpers import SMALL

PNG = b"\x89PNG\r\n\x1a\n"


def _ablation(tmp_path, **spec):
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump({"name": "unit", "base": str(Path("configs/k3_tiny.yaml").resolve()), **spec}))
    return path


@pytest.mark.slow
def test_sweep_runs_tabulates_and_skips_finished_variants(tmp_path, monkeypatch):
    overrides = [*SMALL, "train.steps=6", "train.log_interval=2", "train.eval_interval=3"]
    path = _ablation(tmp_path, overrides=overrides, grid={"data.source": ["embedded", "mqar"]})
    out = tmp_path / "out"
    rows = run_sweep(path, out)
    assert [r["variant"] for r in rows] == ["source-embedded", "source-mqar"]
    for r in rows:
        assert r["steps"] == 6 and (out / r["variant"] / "DONE").is_file()
        assert r["final_train_loss"] > 0 and r["best_val_loss"] <= r["final_val_loss"]
        assert r["tokens_per_s"] > 0 and r["maxvio_running"] is not None
    assert rows[0]["recall_acc"] is None and 0.0 <= rows[1]["recall_acc"] <= 1.0
    table = list(csv.DictReader(open(out / "results.csv")))
    assert [t["variant"] for t in table] == ["source-embedded", "source-mqar"] and "recall_acc" in table[0]
    md = (out / "results.md").read_text()
    assert "| source-mqar | 1234 | 6 | 768 |" in md and "best_val_loss" in md  # variant, seed, steps, tokens
    png = (out / "loss_curves.png").read_bytes()
    assert png[:8] == PNG and len(png) > 1000
    assert (out / "maxvio_curves.png").read_bytes()[:8] == PNG  # MoE runs: balance over training
    cfg = yaml.safe_load((out / "source-mqar" / "config.yaml").read_text())
    assert cfg["logging"]["wandb"]["group"] == "unit" and cfg["logging"]["wandb"]["name"] == "source-mqar"

    def must_not_train(*args, **kwargs):
        raise AssertionError("a finished variant was trained again")

    monkeypatch.setattr(loop, "train", must_not_train)
    (out / "results.md").unlink()
    assert run_sweep(path, out) == rows  # same rows, recomputed from the run directories
    assert (out / "results.md").is_file()
    # Results brought back from a GPU without their checkpoints: the recall computed once is kept.
    shutil.rmtree(out / "source-mqar" / "checkpoints")
    assert run_sweep(path, out) == rows
    (out / "source-mqar" / "recall.json").unlink()
    assert run_sweep(path, out)[1]["recall_acc"] is None  # nothing to compute it from, and no guess

    calls = []
    monkeypatch.setattr(loop, "train", lambda cfg, run_dir, resume=False: calls.append(resume) or {"steps": 6})
    (out / "source-mqar" / "DONE").unlink()  # as if the sweep had been killed during this variant
    run_sweep(path, out)
    assert calls == [True]


def test_named_variants_dry_run_and_errors(tmp_path, capsys):
    path = _ablation(tmp_path, overrides=["train.steps=2"],
                     variants=[{"name": "off", "overrides": ["model.attnres.enabled=false"]},
                               {"name": "b4", "overrides": ["model.attnres.block_size=4"]}])
    assert cli_main(["sweep", str(path), "--out", str(tmp_path / "o"), "--dry-run", "train.seed=3"]) == 0
    assert "off" in capsys.readouterr().out and not (tmp_path / "o").exists()
    sweep = load_sweep(path)
    cfg = variant_config(sweep, sweep.variants[0], ["train.seed=3"])
    assert (cfg.model.attnres.enabled, cfg.train.seed, cfg.logging.wandb.name) == (False, 3, "off")
    with pytest.raises(ConfigError, match="exactly one of"):
        load_sweep(_ablation(tmp_path, grid={"optim.name": ["adamw"]}, variants=[{"name": "x"}]))
    with pytest.raises(ConfigError, match="(?s)sweep variant 'x'.*unknown config key"):
        s = load_sweep(_ablation(tmp_path, variants=[{"name": "x", "overrides": ["train.stepz=1"]}]))
        variant_config(s, s.variants[0])


SHIPPED = sorted(str(p.relative_to("configs/ablations").with_suffix("")) for p in Path("configs/ablations").rglob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_ablation_files_resolve(name):
    sweep = load_sweep(f"configs/ablations/{name}.yaml")
    assert len(sweep.variants) >= 2
    for v in expand_seeds(sweep):
        variant_config(sweep, v)


def test_the_shipped_list_holds_every_study():
    assert {"attnres", "balancing", "gpu/attnres", "gpu/mqar", "gpu/optimizer"} <= set(SHIPPED)


def test_rerun_with_other_settings_refuses_finished_variants(tmp_path, monkeypatch, capsys):
    from k3train.errors import RunDirError

    calls = []

    def fake_train(cfg, run_dir, resume=False):
        run_dir.mkdir(parents=True, exist_ok=True)
        calls.append((run_dir.name, cfg.optim.lr))
        return {"steps": cfg.train.steps}

    monkeypatch.setattr(loop, "train", fake_train)
    path = _ablation(tmp_path, overrides=["train.steps=2"], grid={"optim.name": ["adamw", "muon"]})
    out = tmp_path / "out"
    run_sweep(path, out)
    assert [c[0] for c in calls] == ["name-adamw", "name-muon"]
    calls.clear()
    run_sweep(path, out, ["logging.progress_bar=false"])  # logging does not change what is trained
    run_sweep(path, out, ["kernels.autotune=fixed"])  # nor do the implementations of the same math
    assert calls == []
    with pytest.raises(RunDirError, match=r"\['name-adamw', 'name-muon'\].*other settings.*--out"):
        run_sweep(path, out, ["optim.lr=1e-4"])
    assert calls == [], "nothing retrained or reused under the new settings"
    assert cli_main(["sweep", str(path), "--out", str(out), "--dry-run", "optim.lr=1e-4"]) == 0
    assert capsys.readouterr().out.count("stale") == 2
    run_sweep(path, tmp_path / "other", ["optim.lr=1e-4"])  # another --out trains them afresh
    assert calls == [("name-adamw", 1e-4), ("name-muon", 1e-4)]


def test_seeds_expand_variants_and_tabulate_mean_and_std(tmp_path, monkeypatch):
    """Each variant runs once per seed with train.seed set; the table over seeds holds the mean and
    the sample standard deviation (checked against numpy) of the per-run values."""
    import json

    import numpy as np

    seen = []

    def fake_train(cfg, run_dir, resume=False):
        # a loss that depends on the variant and the seed, so that mean and spread are known
        base = 2.0 if cfg.optim.name == "adamw" else 3.0
        run_dir.mkdir(parents=True, exist_ok=True)
        recs = [{"step": s, "loss": base + 0.1 * cfg.train.seed + 1.0 / s,
                 "val_loss": base + 0.01 * cfg.train.seed ** 2 + 1.0 / s} for s in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        seen.append((run_dir.name, cfg.train.seed, cfg.logging.wandb.name))
        return {"steps": 2}

    monkeypatch.setattr(loop, "train", fake_train)
    path = _ablation(tmp_path, overrides=["train.steps=2"], grid={"optim.name": ["adamw", "muon"]}, seeds=[1, 2, 4])
    out = tmp_path / "out"
    rows = run_sweep(path, out)
    names = [f"name-{o}_seed-{s}" for o in ("adamw", "muon") for s in (1, 2, 4)]
    assert [r["variant"] for r in rows] == names
    assert seen == [(n, int(n[-1]), n) for n in names]
    seeds = np.array([1, 2, 4])
    table = {r["variant"]: r for r in csv.DictReader(open(out / "results_seeds.csv"))}
    assert set(table) == {"name-adamw", "name-muon"}
    for name, base in (("name-adamw", 2.0), ("name-muon", 3.0)):
        val = base + 0.01 * seeds ** 2 + 0.5
        assert int(table[name]["n"]) == 3
        assert float(table[name]["final_val_loss_mean"]) == pytest.approx(val.mean(), abs=1e-12)
        assert float(table[name]["final_val_loss_std"]) == pytest.approx(val.std(ddof=1), abs=1e-12)
        assert float(table[name]["final_train_loss_std"]) == pytest.approx((0.1 * seeds).std(ddof=1), abs=1e-12)
    t = variant_config(load_sweep(path), load_sweep(path).variants[0]).train
    assert int(table["name-adamw"]["tokens"]) == 2 * t.seq_len * t.micro_batch_size * t.microbatches
    md = (out / "results.md").read_text()
    assert "## Over seeds" in md and "| name-muon | 3 |" in md and " ± " in md

    seen.clear()  # --seeds replaces the file's list
    run_sweep(path, tmp_path / "cli", seeds="7")
    assert [s[0] for s in seen] == ["name-adamw_seed-7", "name-muon_seed-7"]
    for bad in ("1,x", "1,1", ""):
        with pytest.raises(ConfigError, match="--seeds"):
            run_sweep(path, tmp_path / "bad", seeds=bad)
    with pytest.raises(ConfigError, match="'seeds'"):
        load_sweep(_ablation(tmp_path, grid={"optim.name": ["adamw"]}, seeds=[1, True]))


@pytest.mark.slow
def test_jobs_train_in_subprocesses_with_the_results_of_one_process(tmp_path):
    """--jobs 2 trains the variants in two `sweep --only` processes at once; every row equals the
    one-process sweep's (CPU training is deterministic), and --only trains just what it names."""
    overrides = [*SMALL, "train.steps=3", "train.log_interval=1", "train.eval_interval=3",
                 "logging.progress_bar=false"]
    path = _ablation(tmp_path, overrides=overrides, grid={"model.attnres.enabled": [True, False]})
    serial = run_sweep(path, tmp_path / "serial")
    parallel = run_sweep(path, tmp_path / "parallel", jobs=2)
    keys = ("variant", "steps", "tokens", "final_train_loss", "final_val_loss", "best_val_loss")
    assert [{k: r[k] for k in keys} for r in parallel] == [{k: r[k] for k in keys} for r in serial]
    assert all((tmp_path / "parallel" / "logs" / f"{r['variant']}.log").is_file() for r in parallel)
    one = run_sweep(path, tmp_path / "one", only="enabled-false")
    assert [r["variant"] for r in one] == ["enabled-false"] and not (tmp_path / "one" / "enabled-true").exists()
    with pytest.raises(ConfigError, match="no such variant.*allowed"):
        run_sweep(path, tmp_path / "one", only="enabled-maybe")


def test_jobs_that_run_out_of_gpu_memory_say_so(tmp_path, monkeypatch, capsys):
    """Too many --jobs on one GPU fail with CUDA's out-of-memory error in each variant's log:
    the sweep names that cause and the fix, not only "did not finish"."""
    import subprocess

    from k3train.errors import RunDirError

    class OutOfMemory:  # a variant process that dies as CUDA's allocator makes it
        def __init__(self, cmd, stdout, stderr):
            stdout.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB.\n")
            stdout.flush()
            self.returncode = 1

        def poll(self):
            return self.returncode

    monkeypatch.setattr(subprocess, "Popen", OutOfMemory)
    path = _ablation(tmp_path, overrides=[*SMALL, "train.steps=2"], grid={"model.attnres.enabled": [True, False]})
    with pytest.raises(RunDirError, match="2 of them ran out of GPU memory with 2 jobs at once: rerun with a smaller --jobs"):
        run_sweep(path, tmp_path / "out", jobs=2)
    assert capsys.readouterr().out.count("it ran out of GPU memory") == 2


def test_collect_tabulates_finished_variants_and_names_the_rest(tmp_path, monkeypatch, capsys):
    """--collect trains nothing: the finished seeds are tabulated (the table over seeds over the
    seeds that are there), the unfinished ones are named in results.md and on the console, and
    one that logged steps gets a row of how far it got."""
    import json

    def fake_train(cfg, run_dir, resume=False):
        run_dir.mkdir(parents=True, exist_ok=True)
        rec = {"step": 2, "loss": 1.0 + cfg.train.seed, "val_loss": 2.0 + cfg.train.seed}
        (run_dir / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
        return {"steps": 2}

    monkeypatch.setattr(loop, "train", fake_train)
    path = _ablation(tmp_path, overrides=["train.steps=2"], grid={"optim.name": ["adamw", "muon"]}, seeds=[1, 2])
    out = tmp_path / "out"
    run_sweep(path, out, only="name-adamw_seed-1,name-adamw_seed-2,name-muon_seed-2")  # one run left undone
    # ... that a cut-off session had started: a logged step, no DONE
    (out / "name-muon_seed-1").mkdir()
    (out / "name-muon_seed-1" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 7.5}) + "\n")

    def must_not_train(*args, **kwargs):
        raise AssertionError("--collect trained a variant")

    monkeypatch.setattr(loop, "train", must_not_train)
    assert cli_main(["sweep", str(path), "--out", str(out), "--collect"]) == 0
    printed = capsys.readouterr().out
    assert "1 of 4 variants not finished" in printed
    assert "name-muon_seed-1: logged step 1 of 2, train loss 7.5000, val loss -" in printed
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["variant"] for r in rows] == ["name-adamw_seed-1", "name-adamw_seed-2", "name-muon_seed-2"]
    seeds = {r["variant"]: r for r in csv.DictReader(open(out / "results_seeds.csv"))}
    assert int(seeds["name-adamw"]["n"]) == 2 and float(seeds["name-adamw"]["final_val_loss_mean"]) == 3.5
    assert int(seeds["name-muon"]["n"]) == 1 and float(seeds["name-muon"]["final_val_loss_mean"]) == 4.0
    md = (out / "results.md").read_text()
    assert "Not finished, so not in these tables (1): name-muon_seed-1." in md
    assert "| name-muon_seed-1 | 1 | 2 | 7.5000 |  |" in md  # how far it got: step 1 of 2
    with pytest.raises(Exception, match="no finished variant"):
        run_sweep(path, tmp_path / "empty", collect=True)


def test_tune_tabulates_each_family_at_its_best_value(tmp_path, monkeypatch):
    """``tune: optim.lr``: the variants that differ only in the learning rate form a family; the
    table gives each at its best rate by the mean over seeds (checked against a hand computation
    from the fake losses), says when the best rate is at the edge of those tried, and refuses a
    key the config does not have before training anything."""
    import json
    import math
    import statistics

    def val_loss(name, lr, seed):  # adamw best at 1e-3 (inside the range), muon at 1e-2 (the edge)
        best = 1e-3 if name == "adamw" else 1e-2
        return 2.0 + abs(math.log10(lr / best)) + 0.05 * seed

    trained = []

    def fake_train(cfg, run_dir, resume=False):
        run_dir.mkdir(parents=True, exist_ok=True)
        v = val_loss(cfg.optim.name, cfg.optim.lr, cfg.train.seed)
        recs = [{"step": 1, "loss": v, "val_loss": v}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        trained.append(run_dir.name)
        return {"steps": 1}

    monkeypatch.setattr(loop, "train", fake_train)
    lrs = [1.0e-4, 1.0e-3, 1.0e-2]
    path = _ablation(tmp_path, overrides=["train.steps=1"], tune="optim.lr",
                     grid={"optim.name": ["adamw", "muon"], "optim.lr": lrs}, seeds=[1, 2])
    out = tmp_path / "out"
    run_sweep(path, out)
    table = {r["family"]: r for r in csv.DictReader(open(out / "results_tuned.csv"))}
    assert set(table) == {"optim.name=adamw", "optim.name=muon"}
    for name, best, edge in (("adamw", 1e-3, "False"), ("muon", 1e-2, "True")):
        row = table[f"optim.name={name}"]
        want = [val_loss(name, best, s) for s in (1, 2)]
        assert float(row["best_optim.lr"]) == best and row["at_edge"] == edge and row["n"] == "2"
        assert float(row["final_val_loss_mean"]) == pytest.approx(statistics.fmean(want), abs=1e-12)
        assert float(row["final_val_loss_std"]) == pytest.approx(statistics.stdev(want), abs=1e-12)
        assert row["tried"].count("n=2") == len(lrs)
    md = (out / "results.md").read_text()
    assert "## Each family at its best optim.lr (by final_val_loss, lower is better)" in md
    assert "yes: optimum not bracketed" in md

    trained.clear()
    bad = _ablation(tmp_path, overrides=["train.steps=1"], tune="optim.lrr", grid={"optim.lr": lrs})
    with pytest.raises(ConfigError, match="'tune: optim.lrr' is not a config key"):
        run_sweep(bad, tmp_path / "bad")
    assert trained == []
    for spec, match in (({"tune": ["optim.lr"]}, "'tune' must be one config key"),
                        ({"tune": "optim.lr", "tune_metric": "speed"}, "'tune_metric' must be one of")):
        with pytest.raises(ConfigError, match=match):
            load_sweep(_ablation(tmp_path, grid={"optim.lr": lrs}, **spec))


def test_tuned_table_picks_the_highest_recall():
    from k3train.sweep.runner import Variant
    from k3train.sweep.results import tuned_table

    variants = [Variant(f"m_lr{i}", ["model.layer_pattern=M", f"optim.lr={lr}"]) for i, lr in enumerate((1, 2, 3))]
    rows = [{"recall_acc": r} for r in (0.2, 0.9, 0.5)]
    (row,) = tuned_table(rows, variants, "optim.lr", "recall_acc", {v.name: lr for v, lr in zip(variants, (1, 2, 3))})
    assert (row["family"], row["best"], row["mean"], row["at_edge"]) == ("model.layer_pattern=M", 2, 0.9, False)


def test_only_selects_a_run_or_every_seed_of_a_variant():
    from k3train.sweep.runner import _select

    runs = expand_seeds(load_sweep("configs/ablations/mqar_cpu.yaml"))
    assert [v.name for v in _select(runs, "K_head_gate")] == ["K_head_gate_seed-1", "K_head_gate_seed-2"]
    assert [v.name for v in _select(runs, "K")] == ["K_seed-1", "K_seed-2"]          # not K_head_gate's
    assert [v.name for v in _select(runs, "M_seed-2,K")] == ["K_seed-1", "K_seed-2", "M_seed-2"]
    with pytest.raises(ConfigError, match=r"--only \['KM'\]: no such variant; allowed: .*'K_seed-1'.*'KKKM'"):
        _select(runs, "KM")


def test_done_written_before_a_config_field_was_added_stays_done(tmp_path):
    """A DONE key hashes the schema of its day; the run's own config.yaml, read under today's
    schema, decides when the key differs (a new field at its default changes nothing)."""
    import json

    from k3train.config import load_config
    from k3train.trainer.run_dir import save_config
    from k3train.sweep.runner import _done_state

    cfg = load_config("configs/k3_tiny.yaml", ["optim.lr=1e-3"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "DONE").write_text(json.dumps({"steps": 3, "config_key": "hash of an older schema"}) + "\n")
    assert _done_state(run, cfg) == "stale"                       # no config.yaml to go by
    save_config(cfg, run / "config.yaml")
    assert _done_state(run, cfg) == "done"
    assert _done_state(run, load_config("configs/k3_tiny.yaml", ["optim.lr=2e-3"])) == "stale"


def test_a_fresh_variant_starts_plainly_and_a_started_one_resumes(tmp_path, monkeypatch):
    calls = []

    def fake_train(cfg, run_dir, resume=False):
        calls.append((run_dir.name, resume))
        run_dir.mkdir(parents=True, exist_ok=True)
        return {"steps": cfg.train.steps}

    monkeypatch.setattr(loop, "train", fake_train)
    path = _ablation(tmp_path, overrides=["train.steps=2"], grid={"optim.name": ["adamw", "muon"]})
    out = tmp_path / "out"
    (out / "name-muon").mkdir(parents=True)
    (out / "name-muon" / "metrics.jsonl").write_text("")  # what a killed variant left behind
    run_sweep(path, out)
    assert calls == [("name-adamw", False), ("name-muon", True)]
