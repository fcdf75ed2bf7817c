"""Tabulating a sweep: one row per finished run (``collect_result``), how far an unfinished one
got (``unfinished_progress``), the tables over seeds and over a tuned key, and the files they
go to (``results.csv``, ``results.md``, ``results_seeds.csv``, ``results_tuned.csv``).
``k3train.sweep.runner`` runs the variants and calls these; they read run directories only."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from k3train.config import RunConfig
from k3train.data.mqar import mqar_val_batches, recall_accuracy
from k3train.errors import RunDirError
from k3train.model.model import build_model
from k3train.runtime.device import resolve_device
from k3train.runtime.distributed import init_distributed
from k3train.sweep.curves import FINAL_OF, last_value, series, spread
from k3train.sweep.spec import Variant
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.plots import read_metrics
from k3train.trainer.state_io import consolidated_state

COLUMNS = ("variant", "seed", "steps", "tokens", "final_train_loss", "final_val_loss", "best_val_loss", "tokens_per_s",
           "maxvio_running", "recall_acc")


# Columns averaged over seeds in the table over seeds (mean and sample standard deviation).
SEED_METRICS = ("final_train_loss", "final_val_loss", "best_val_loss", "maxvio_running", "recall_acc",
                "tokens_per_s")

# What each column of results.md means; the footnote names only the columns the table has.
COLUMN_NOTES = {
    "tokens": "tokens trained on",
    "final_train_loss": "last logged training loss",
    "final_val_loss": "last validation loss",
    "best_val_loss": "lowest validation loss",
    "tokens_per_s": "mean over logged steps",
    "maxvio_running": "last logged moe/maxvio_running, the MaxVio of the load since step 1 (MoE runs; "
                      "maxvio_curves.png ends on it)",
    "recall_acc": "MQAR validation recall of the final checkpoint",
}
# The rule for throughput measured on a CPU (docs/ablations.md): a CPU is usually shared (other
# processes, other variants' --jobs), so its tokens/s moves with their load. results.md labels
# the column as indicative and the table over seeds leaves it out (a mean and spread of it would
# read as a measurement); results.csv keeps the raw value with a device column.
CPU_SPEED = "tokens_per_s (CPU, indicative)"
CPU_SPEED_NOTE = ("measured on a CPU, which other processes share: it moves with their load, so it is "
                  "not averaged over seeds and not a comparison between variants")


def _final_recall_accuracy(cfg: RunConfig, run_dir: Path) -> float | None:
    """MQAR recall accuracy of the run's final checkpoint on its validation batches, on the run's
    device (one-process layouts only: the model is built here under the run's own layout)."""

    p = cfg.parallel
    if (p.tp, p.pp, p.ep) != (1, 1, 1):
        return None
    # Computed once per final checkpoint and kept: a re-tabulation of results brought back
    # without their checkpoints (from a GPU machine, say) reuses it.
    saved = run_dir / "recall.json"
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if saved.is_file():
        try:
            kept = json.loads(saved.read_text())
            if ckpt is None or kept.get("checkpoint") == ckpt.name:
                return kept["recall_acc"]
        except (ValueError, KeyError, TypeError):
            pass
    if ckpt is None:
        return None
    init_distributed(p.tp, p.pp, p.vpp, p.ep)
    # on the run's device: on CPU the naive KDA recurrence makes this minutes for a dozen variants
    device = resolve_device(cfg.train.device)
    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(consolidated_state(ckpt, optimizer=False)["model"], strict=False)
    bad = [k for k in [*missing, *unexpected] if not k.endswith("_extra_state")]  # megatron's, never saved
    if bad:
        raise RunDirError(f"{ckpt} does not hold this variant's model (e.g. {bad[:3]}); rerun it with another --out")
    model.to(device)
    t = cfg.train
    acc = recall_accuracy(model, mqar_val_batches(cfg.data.mqar, t.seq_len, t.micro_batch_size, t.eval_batches),
                          cfg.data.mqar, device=device)
    saved.write_text(json.dumps({"recall_acc": acc, "checkpoint": ckpt.name}) + "\n")
    return acc


def run_device(cfg: RunConfig, run_dir: Path) -> str:
    """The device type a run trained on: its ``kernels.json`` (written at start-up), else what
    ``train.device`` resolves to here."""
    try:
        return str(json.loads((run_dir / "kernels.json").read_text())["device"])
    except (OSError, ValueError, KeyError, TypeError):
        return resolve_device(cfg.train.device).type


def collect_result(name: str, cfg: RunConfig, run_dir: Path) -> tuple[dict, list[dict]]:
    """One results row for ``run_dir`` (metrics.jsonl and, for MQAR, the final checkpoint) and
    its metrics records. The final values are ``k3train.sweep.curves.last_value`` of the curves
    the plots draw."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    val = series(records, FINAL_OF["final_val_loss"])[1]
    speed = series(records, "tokens_per_s")[1]
    steps = records[-1]["step"] if records else None
    t = cfg.train
    row = {
        "variant": name,
        "seed": t.seed,
        "steps": steps,
        # tokens trained on (a sweep runs its variants in one process: data-parallel size 1)
        "tokens": steps * t.seq_len * t.micro_batch_size * t.microbatches if steps else None,
        "final_train_loss": last_value(records, FINAL_OF["final_train_loss"]),
        "final_val_loss": last_value(records, FINAL_OF["final_val_loss"]),
        "best_val_loss": min(val) if val else None,
        "tokens_per_s": sum(speed) / len(speed) if speed else None,
        "maxvio_running": last_value(records, FINAL_OF["maxvio_running"]),
        "recall_acc": _final_recall_accuracy(cfg, run_dir) if cfg.data.source == "mqar" else None,
        "device": run_device(cfg, run_dir),
    }
    return row, records


def unfinished_progress(name: str, cfg: RunConfig, run_dir: Path) -> dict | None:
    """How far a run without ``DONE`` got, from its ``metrics.jsonl``: ``{"variant", "step",
    "steps", "loss", "val_loss"}`` (the last logged step and training loss, the last validation
    loss or None, of ``train.steps``), or None where nothing was logged. A study cut off by the
    end of a device session still says which runs had learned."""
    metrics = run_dir / "metrics.jsonl"
    records = [r for r in (read_metrics(metrics) if metrics.is_file() else []) if "step" in r]
    if not records:
        return None
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    losses = [r for r in records if r.get("loss") is not None]
    return {"variant": name, "step": records[-1]["step"], "steps": cfg.train.steps,
            "loss": losses[-1]["loss"] if losses else None, "val_loss": val[-1] if val else None}


def seed_table(rows: list[dict], variants: list[Variant]) -> list[dict]:
    """Rows over seeds: per variant group, ``n`` seeds, ``tokens`` (of one run), and
    ``<metric>_mean`` / ``<metric>_std`` (sample standard deviation, n-1; 0 for one seed), by
    ``k3train.sweep.curves.spread`` (the plots' means and bands too)."""
    groups: dict[str, list[dict]] = {}
    for v, r in zip(variants, rows):
        groups.setdefault(v.group or v.name, []).append(r)
    out = []
    for name, rs in groups.items():
        agg = {"variant": name, "n": len(rs), "tokens": rs[0].get("tokens")}
        for m in SEED_METRICS:
            sp = spread([r[m] for r in rs if r.get(m) is not None])
            agg[f"{m}_mean"], agg[f"{m}_std"] = sp["mean"], sp["std"]
        out.append(agg)
    return out


def tuned_table(rows: list[dict], variants: list[Variant], tune: str, metric: str,
                values: dict[str, object]) -> list[dict]:
    """Each family (the variants whose overrides differ only in ``tune`` and the seed) at its
    best value of ``tune`` by the mean of ``metric`` over seeds (highest recall, else lowest).

    values: run name -> that run's value of ``tune``. Returns per family ``{"family", "best",
    "mean", "std", "n", "at_edge", "tried": [(value, mean, n), ...]}``; ``at_edge`` says the best
    value is the smallest or largest tried (None with one value or non-numeric values)."""
    import statistics

    prefix = (f"{tune}=", "train.seed=")
    cells: dict[tuple, dict[object, list[float]]] = {}
    for v, r in zip(variants, rows):
        family = tuple(o for o in v.overrides if not o.startswith(prefix))
        cell = cells.setdefault(family, {}).setdefault(values[v.name], [])
        if r.get(metric) is not None:
            cell.append(r[metric])
    sign = -1.0 if metric == "recall_acc" else 1.0
    out = []
    for family, by_value in cells.items():
        tried = [(val, statistics.fmean(xs), len(xs)) for val, xs in by_value.items() if xs]
        if not tried:
            continue
        best, mean, n = min(tried, key=lambda t: sign * t[1])
        xs = by_value[best]
        numeric = all(isinstance(t[0], (int, float)) and not isinstance(t[0], bool) for t in tried)
        edge = best in (min(t[0] for t in tried), max(t[0] for t in tried)) if numeric and len(tried) > 1 else None
        out.append({"family": ", ".join(family) or "(base)", "best": best, "mean": mean,
                    "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": n, "at_edge": edge,
                    "tried": sorted(tried, key=lambda t: t[0]) if numeric else tried})
    return out


def _tuned_lines(table: list[dict], tune: str, metric: str, out: Path) -> list[str]:
    """The markdown table of each family at its best ``tune``, and ``out/results_tuned.csv``."""
    better = "higher" if metric == "recall_acc" else "lower"
    with open(out / "results_tuned.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["family", f"best_{tune}", f"{metric}_mean", f"{metric}_std", "n", "at_edge", "tried"])
        for r in table:
            writer.writerow([r["family"], r["best"], r["mean"], r["std"], r["n"],
                             "" if r["at_edge"] is None else r["at_edge"],
                             "; ".join(f"{v}: {m!r} (n={k})" for v, m, k in r["tried"])])
    lines = [f"## Each family at its best {tune} (by {metric}, {better} is better)", "",
             f"| family | best {tune} | {metric} | n | at the edge of the range tried | tried ({tune}: mean) |",
             "|---|---|---|---|---|---|"]
    for r in table:
        edge = {None: "", True: "yes: optimum not bracketed", False: "no"}[r["at_edge"]]
        tried = ", ".join(f"{v}: {format_cell(m)}" for v, m, _ in r["tried"])
        lines.append(f"| {r['family']} | {r['best']} | {format_cell(r['mean'])} ± {format_cell(r['std'])} | {r['n']} | "
                     f"{edge} | {tried} |")
    return [*lines, ""]


def format_cell(value) -> str:
    """A table cell: empty for None, floats to 4 decimals (1 at 100 and above)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4f}"
    return str(value)


def on_cpu(rows: list[dict]) -> bool:
    """Whether any tabulated run trained on a CPU (then ``CPU_SPEED``'s rule applies)."""
    return any(r.get("device") == "cpu" for r in rows)


def write_results(rows: list[dict], out: Path, title: str,
                  variants: list[Variant] | None = None, missing: list[str] = (),
                  tune: tuple[str, str, dict] | None = None, progress: list[dict] = (),
                  header: list[str] = ()) -> tuple[Path, Path]:
    """``out/results.csv`` (full precision, empty cells for n/a) and ``out/results.md``; with
    seeded ``variants`` also ``out/results_seeds.csv`` and a table over seeds in results.md.
    ``missing``: variants of the sweep without a row, named under the tables. ``tune``: (key,
    metric, run name -> value) adds each family at its best value (:func:`tuned_table`) and
    ``out/results_tuned.csv``. ``progress``: :func:`unfinished_progress` rows of the missing
    runs that logged something, tabulated under their names. ``header``: lines under the
    title (how the sweep was run: its file, command-line overrides, seeds)."""
    cols = [c for c in COLUMNS if c in ("variant", "steps") or any(r.get(c) is not None for r in rows)]
    cpu = on_cpu(rows)
    csv_path, md_path = out / "results.csv", out / "results.md"
    csv_cols = [*cols, *(["device"] if any(r.get("device") for r in rows) else [])]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=csv_cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c: ("" if r.get(c) is None else r[c]) for c in csv_cols} for r in rows)
    names = [CPU_SPEED if c == "tokens_per_s" and cpu else c for c in cols]
    lines = [f"# Sweep {title}", "", *header, *([""] if header else []),
             "| " + " | ".join(names) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(format_cell(r.get(c)) for c in cols) + " |" for r in rows]
    notes = [f"{name}: {COLUMN_NOTES[c]}" + (f", {CPU_SPEED_NOTE}" if name == CPU_SPEED else "")
             for c, name in zip(cols, names) if c in COLUMN_NOTES]
    lines += ["", "; ".join(notes) + ".", ""]
    if variants and any(v.seed is not None for v in variants):
        lines += _seed_lines(seed_table(rows, variants), out, cpu)
    if variants and tune is not None:
        key, metric, values = tune
        lines += _tuned_lines(tuned_table(rows, variants, key, metric, values), key, metric, out)
    if missing:
        lines += [f"Not finished, so not in these tables ({len(missing)}): {', '.join(missing)}.", ""]
    if progress:
        lines += ["How far the unfinished runs got (last logged values):", "",
                  "| run | step | of | train loss | val loss |", "|---|---|---|---|---|"]
        lines += [f"| {p['variant']} | {p['step']} | {p['steps']} | {format_cell(p['loss'])} | {format_cell(p['val_loss'])} |"
                  for p in progress]
        lines.append("")
    md_path.write_text("\n".join(lines))
    return md_path, csv_path


def _seed_lines(table: list[dict], out: Path, cpu: bool = False) -> list[str]:
    """The markdown table over seeds (mean ± std), and ``out/results_seeds.csv`` beside it;
    ``cpu``: without tokens_per_s (``CPU_SPEED``'s rule)."""
    metrics = [m for m in SEED_METRICS if any(r.get(f"{m}_mean") is not None for r in table)
               and not (cpu and m == "tokens_per_s")]
    with open(out / "results_seeds.csv", "w", newline="") as f:
        fields = ["variant", "n", "tokens", *(f"{m}_{s}" for m in metrics for s in ("mean", "std"))]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c: ("" if r.get(c) is None else r[c]) for c in fields} for r in table)
    lines = ["## Over seeds (mean ± sample standard deviation; the plots' lines are these means, "
             "their bands the seeds' min..max)", "",
             "| variant | n | tokens | " + " | ".join(metrics) + " |", "|" + "---|" * (3 + len(metrics))]
    for r in table:
        cells = [f"{format_cell(r[f'{m}_mean'])} ± {format_cell(r[f'{m}_std'])}" if r.get(f"{m}_mean") is not None else ""
                 for m in metrics]
        lines.append(f"| {r['variant']} | {r['n']} | {format_cell(r['tokens'])} | " + " | ".join(cells) + " |")
    return [*lines, ""]
