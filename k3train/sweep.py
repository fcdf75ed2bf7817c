"""Ablation sweeps: ``k3train sweep configs/ablations/NAME.yaml [--out DIR] [--dry-run]``.

An ablation file::

    name: attnres                  # optional; default the file name
    base: configs/k3_tiny.yaml     # run config every variant starts from
    overrides: [train.steps=60]    # applied to every variant
    grid:                          # either a cartesian product of values ...
      model.attnres.enabled: [true, false]
      optim.name: [adamw, muon]
    variants:                      # ... or named override lists (instead of grid)
      - {name: off, overrides: [model.attnres.enabled=false]}
    seeds: [1, 2, 3]               # optional: every variant once per train.seed
    tune: optim.lr                 # optional: a key the variants sweep as tuning, not as a factor
    tune_metric: final_val_loss    # optional: what "best" means for it (default final_val_loss)

With ``seeds`` (or ``k3train sweep FILE --seeds 1,2,3``, which replaces the file's list) each
variant runs once per seed, in ``OUT/<variant>_seed-<S>/`` with ``train.seed=S`` (model
initialisation and data order), and ``results.md`` gains a table over seeds: per variant, the
mean and the sample standard deviation of each metric, with the number of seeds and tokens.

With ``tune`` the variants that differ only in that key (a learning-rate sweep per optimizer,
say) form one family, and ``results.md`` gains a table of each family at its best value of the
key (by ``tune_metric``, over seeds when there are seeds: the lowest mean loss or MaxVio, the
highest mean recall), with every value tried and whether the best one lies at the edge of the
range tried (its optimum then not bracketed). That is matched tuning effort: each family
compared at its own best setting.

Variants run one after another in this process (``k3train.trainer.loop.train``), each in
``OUT/<variant>/``. A finished variant's directory holds ``DONE``, keyed by the variant's
resolved config (``config_key``); a rerun skips it when the key matches and refuses when it
does not (the variant was made with other settings: another ``--out`` keeps both). One with a
checkpoint but no ``DONE`` (an interrupted sweep) resumes from it. ``--only NAME,...`` trains
and tabulates just those variants (a seeded run's name, or a variant's for all its seeds); ``--collect`` trains nothing and tabulates the finished ones
(run directories brought back from other machines, even without their checkpoints), naming the
rest; ``--jobs N`` trains N variants at once, each in a
``k3train sweep --only NAME`` subprocess (small models share one GPU well), then tabulates. Results go to ``OUT/results.md``,
``OUT/results.csv``, ``OUT/loss_curves.png`` and, for MoE runs, ``OUT/maxvio_curves.png``.
"""
from __future__ import annotations

import csv
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from k3train.config import ConfigError, RunConfig, load_config
from k3train.errors import RunDirError
from k3train.plots import plot_loss_curves, plot_metric_curves, read_metrics

__all__ = ["Sweep", "Variant", "load_sweep", "run_sweep", "collect_result", "write_results"]

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
COLUMNS = ("variant", "seed", "steps", "tokens", "final_train_loss", "final_val_loss", "best_val_loss", "tokens_per_s",
           "maxvio_running", "recall_acc")


# Columns averaged over seeds in the table over seeds (mean and sample standard deviation).
SEED_METRICS = ("final_train_loss", "final_val_loss", "best_val_loss", "maxvio_running", "recall_acc",
                "tokens_per_s")
# What a tuned key can be chosen by; recall is best high, the others low.
TUNE_METRICS = ("final_val_loss", "best_val_loss", "final_train_loss", "maxvio_running", "recall_acc")


@dataclass
class Variant:
    name: str
    overrides: list[str]
    group: str | None = None  # the variant a seeded copy belongs to (None without seeds)
    seed: int | None = None


@dataclass
class Sweep:
    name: str
    base: Path
    overrides: list[str]
    variants: list[Variant] = field(default_factory=list)
    seeds: list[int] | None = None
    tune: str | None = None
    tune_metric: str = "final_val_loss"


def _value_text(value) -> str:
    """A grid value as an override right-hand side (YAML, so `true`, `1e-3`, `[1, 2]` round-trip)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _grid_variants(grid: dict) -> list[Variant]:
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep grid entry '{key}' must be a non-empty list of values")
    keys = list(grid)
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        texts = [_value_text(v) for v in combo]
        name = "_".join(f"{k.split('.')[-1]}-{re.sub(r'[^A-Za-z0-9_.+-]', '', t)}" for k, t in zip(keys, texts))
        out.append(Variant(name, [f"{k}={t}" for k, t in zip(keys, texts)]))
    return out


def _named_variants(items) -> list[Variant]:
    if not isinstance(items, list) or not items:
        raise ConfigError("sweep 'variants' must be a non-empty list of {name, overrides}")
    out = []
    for item in items:
        if not isinstance(item, dict) or "name" not in item:
            raise ConfigError(f"sweep variant {item!r} needs a 'name' (and an 'overrides' list)")
        if not isinstance(item["name"], str):  # YAML reads a bare off/yes/1 as a bool or number
            raise ConfigError(f"sweep variant name {item['name']!r} is not a string; quote it in the file")
        overrides = item.get("overrides") or []
        if not isinstance(overrides, list):
            raise ConfigError(f"sweep variant '{item['name']}': 'overrides' must be a list of key=value")
        out.append(Variant(str(item["name"]), [str(o) for o in overrides]))
    return out


def load_sweep(path: str | Path) -> Sweep:
    """Parse and check an ablation file (the module docstring gives the format)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"ablation file '{path}' does not exist (configs/ablations/ lists the shipped ones)")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - {"name", "base", "overrides", "grid", "variants", "seeds", "tune", "tune_metric"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: name, base, overrides, grid, "
                          f"variants, seeds, tune, tune_metric")
    if "base" not in spec:
        raise ConfigError(f"{path}: 'base' (a run config such as configs/k3_tiny.yaml) is required")
    base = Path(spec["base"])
    if not base.is_file() and (path.parent / base).is_file():
        base = path.parent / base
    grid, variants = spec.get("grid"), spec.get("variants")
    if isinstance(grid, dict) and set(grid) == {"variants"}:  # `grid: {variants: [...]}` reads the same
        grid, variants = None, grid["variants"]
    if (grid is None) == (variants is None):
        raise ConfigError(f"{path}: give exactly one of 'grid' (key -> list of values) or 'variants'")
    if grid is not None and not isinstance(grid, dict):
        raise ConfigError(f"{path}: 'grid' must map config keys to lists of values")
    found = _grid_variants(grid) if grid is not None else _named_variants(variants)
    names = [v.name for v in found]
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ConfigError(f"{path}: variant names {bad} must use only letters, digits and _.+-")
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: variant names repeat: {names}")
    overrides = spec.get("overrides") or []
    if not isinstance(overrides, list):
        raise ConfigError(f"{path}: 'overrides' must be a list of key=value")
    seeds = check_seeds(spec["seeds"], f"{path}: 'seeds'") if spec.get("seeds") is not None else None
    tune, metric = spec.get("tune"), spec.get("tune_metric", "final_val_loss")
    if tune is not None and (not isinstance(tune, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", tune)):
        raise ConfigError(f"{path}: 'tune' must be one config key such as optim.lr, got {tune!r}")
    if metric not in TUNE_METRICS:
        raise ConfigError(f"{path}: 'tune_metric' must be one of {', '.join(TUNE_METRICS)}, got {metric!r}")
    return Sweep(str(spec.get("name", path.stem)), base, [str(o) for o in overrides], found, seeds,
                 tune, metric)


def check_seeds(value, what: str = "seeds") -> list[int]:
    """A seed list from the file (a YAML list) or the command line ("1,2,3"): distinct integers."""
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"{what} must be comma-separated integers such as 1,2,3, got {value!r}") from None
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise ConfigError(f"{what} must be a non-empty list of integers >= 0, got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{what} repeat: {value}")
    return list(value)


def expand_seeds(sweep: Sweep, seeds: list[int] | None = None) -> list[Variant]:
    """The runs of a sweep: its variants, or each of them once per seed (``seeds`` replaces the
    file's list). A seeded run appends ``train.seed=S`` after the variant's own overrides."""
    seeds = seeds if seeds is not None else sweep.seeds
    if not seeds:
        return list(sweep.variants)
    return [Variant(f"{v.name}_seed-{s}", [*v.overrides, f"train.seed={s}"], group=v.name, seed=s)
            for v in sweep.variants for s in seeds]


def variant_config(sweep: Sweep, variant: Variant, extra: list[str] = ()) -> RunConfig:
    """base file <- sweep overrides <- wandb group/name <- variant overrides <- command-line extras."""
    # JSON-quoted so that a name like "off" or "1" stays a string when the override is parsed as YAML.
    wandb = [f"logging.wandb.group={json.dumps(sweep.name)}", f"logging.wandb.name={json.dumps(variant.name)}"]
    try:
        return load_config(sweep.base, [*sweep.overrides, *wandb, *variant.overrides, *extra])
    except ConfigError as exc:
        raise ConfigError(f"sweep variant '{variant.name}': {exc}") from None


# Sections that do not change what a variant trains: a rerun that only changes them reuses it.
# ``kernels`` picks implementations of the same math (and gains fields as kernels are added:
# a new kernels field must not turn every finished study stale).
_KEY_IGNORES = ("logging", "checkpoint", "kernels")


def config_key(cfg: RunConfig) -> str:
    """The sha256 of a variant's resolved config (without ``_KEY_IGNORES``), kept in ``DONE``."""
    fields = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in _KEY_IGNORES}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _done_state(run_dir: Path, cfg: RunConfig) -> str:
    """"to run" (no DONE), "done" (DONE with this config's key) or "stale" (DONE of other
    settings, or of a k3train that wrote no key)."""
    done = run_dir / "DONE"
    if not done.is_file():
        return "to run"
    try:
        key = json.loads(done.read_text()).get("config_key")
    except (ValueError, AttributeError):
        key = None
    if key == config_key(cfg):
        return "done"
    # A DONE written before the config gained a field hashes the older schema's dump. The run's
    # own resolved config, read under today's schema (a new field at its default), decides.
    try:
        same = config_key(load_config(run_dir / "config.yaml")) == config_key(cfg)
    except Exception:  # noqa: BLE001 - missing or no longer valid: not the same settings
        same = False
    return "done" if same else "stale"


def _final_recall_accuracy(cfg: RunConfig, run_dir: Path) -> float | None:
    """MQAR recall accuracy of the run's final checkpoint on its validation batches, on the run's
    device (one-process layouts only: the model is built here under the run's own layout)."""
    import torch

    from k3train.data.mqar import mqar_val_batches, recall_accuracy
    from k3train.distributed import init_distributed
    from k3train.model.model import build_model
    from k3train.trainer.checkpoint import latest_checkpoint
    from k3train.trainer.loop import pick_device
    from k3train.trainer.state_io import consolidated_state

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
    device = torch.device(pick_device(cfg.train.device))
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


def collect_result(name: str, cfg: RunConfig, run_dir: Path) -> tuple[dict, list[dict]]:
    """One results row for ``run_dir`` (metrics.jsonl and, for MQAR, the final checkpoint) and
    its metrics records."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    speed = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") is not None]
    maxvio = [r["moe/maxvio_running"] for r in records if r.get("moe/maxvio_running") is not None]
    steps = records[-1]["step"] if records else None
    t = cfg.train
    row = {
        "variant": name,
        "seed": t.seed,
        "steps": steps,
        # tokens trained on (a sweep runs its variants in one process: data-parallel size 1)
        "tokens": steps * t.seq_len * t.micro_batch_size * t.microbatches if steps else None,
        "final_train_loss": records[-1].get("loss") if records else None,
        "final_val_loss": val[-1] if val else None,
        "best_val_loss": min(val) if val else None,
        "tokens_per_s": sum(speed) / len(speed) if speed else None,
        "maxvio_running": maxvio[-1] if maxvio else None,
        "recall_acc": _final_recall_accuracy(cfg, run_dir) if cfg.data.source == "mqar" else None,
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
    ``<metric>_mean`` / ``<metric>_std`` (sample standard deviation, n-1; 0 for one seed)."""
    import statistics

    groups: dict[str, list[dict]] = {}
    for v, r in zip(variants, rows):
        groups.setdefault(v.group or v.name, []).append(r)
    out = []
    for name, rs in groups.items():
        agg = {"variant": name, "n": len(rs), "tokens": rs[0].get("tokens")}
        for m in SEED_METRICS:
            vals = [r[m] for r in rs if r.get(m) is not None]
            agg[f"{m}_mean"] = statistics.fmean(vals) if vals else None
            agg[f"{m}_std"] = statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else None)
        out.append(agg)
    return out


def config_value(cfg: RunConfig, key: str):
    """The value of dotted ``key`` (``optim.lr``) in a resolved run config."""
    node = cfg
    for i, part in enumerate(key.split(".")):
        if not hasattr(node, part) or callable(getattr(node, part)):
            where = ".".join(key.split(".")[:i]) or "the run config"
            raise ConfigError(f"sweep 'tune: {key}' is not a config key ({where} has no '{part}')")
        node = getattr(node, part)
    return node


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
        tried = ", ".join(f"{v}: {_fmt(m)}" for v, m, _ in r["tried"])
        lines.append(f"| {r['family']} | {r['best']} | {_fmt(r['mean'])} ± {_fmt(r['std'])} | {r['n']} | "
                     f"{edge} | {tried} |")
    return [*lines, ""]


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4f}"
    return str(value)


def write_results(rows: list[dict], out: Path, title: str,
                  variants: list[Variant] | None = None, missing: list[str] = (),
                  tune: tuple[str, str, dict] | None = None, progress: list[dict] = ()) -> tuple[Path, Path]:
    """``out/results.csv`` (full precision, empty cells for n/a) and ``out/results.md``; with
    seeded ``variants`` also ``out/results_seeds.csv`` and a table over seeds in results.md.
    ``missing``: variants of the sweep without a row, named under the tables. ``tune``: (key,
    metric, run name -> value) adds each family at its best value (:func:`tuned_table`) and
    ``out/results_tuned.csv``. ``progress``: :func:`unfinished_progress` rows of the missing
    runs that logged something, tabulated under their names."""
    cols = [c for c in COLUMNS if c in ("variant", "steps") or any(r.get(c) is not None for r in rows)]
    csv_path, md_path = out / "results.csv", out / "results.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c: ("" if r.get(c) is None else r[c]) for c in cols} for r in rows)
    lines = [f"# Sweep {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    lines += ["", "tokens: tokens trained on; tokens_per_s: mean over logged steps; maxvio_running: last "
                  "logged value (MoE runs); recall_acc: MQAR validation recall of the final checkpoint.", ""]
    if variants and any(v.seed is not None for v in variants):
        lines += _seed_lines(seed_table(rows, variants), out)
    if variants and tune is not None:
        key, metric, values = tune
        lines += _tuned_lines(tuned_table(rows, variants, key, metric, values), key, metric, out)
    if missing:
        lines += [f"Not finished, so not in these tables ({len(missing)}): {', '.join(missing)}.", ""]
    if progress:
        lines += ["How far the unfinished runs got (last logged values):", "",
                  "| run | step | of | train loss | val loss |", "|---|---|---|---|---|"]
        lines += [f"| {p['variant']} | {p['step']} | {p['steps']} | {_fmt(p['loss'])} | {_fmt(p['val_loss'])} |"
                  for p in progress]
        lines.append("")
    md_path.write_text("\n".join(lines))
    return md_path, csv_path


def _seed_lines(table: list[dict], out: Path) -> list[str]:
    """The markdown table over seeds (mean ± std), and ``out/results_seeds.csv`` beside it."""
    metrics = [m for m in SEED_METRICS if any(r.get(f"{m}_mean") is not None for r in table)]
    with open(out / "results_seeds.csv", "w", newline="") as f:
        fields = ["variant", "n", "tokens", *(f"{m}_{s}" for m in metrics for s in ("mean", "std"))]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c: ("" if r.get(c) is None else r[c]) for c in fields} for r in table)
    lines = ["## Over seeds (mean ± sample standard deviation)", "",
             "| variant | n | tokens | " + " | ".join(metrics) + " |", "|" + "---|" * (3 + len(metrics))]
    for r in table:
        cells = [f"{_fmt(r[f'{m}_mean'])} ± {_fmt(r[f'{m}_std'])}" if r.get(f"{m}_mean") is not None else ""
                 for m in metrics]
        lines.append(f"| {r['variant']} | {r['n']} | {_fmt(r['tokens'])} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _select(runs: list[Variant], only: list[str] | str | None) -> list[Variant]:
    """The runs ``--only`` names: a run's own name (``K_seed-2``) or, with seeds, its variant's
    (``K``: every seed of it)."""
    if only is None:
        return runs
    names = [n for n in only.split(",") if n] if isinstance(only, str) else list(only)
    groups = {v.group for v in runs if v.seed is not None}
    unknown = [n for n in names if n not in {v.name for v in runs} | groups]
    if unknown or not names:
        allowed = [v.name for v in runs] + sorted(groups)
        raise ConfigError(f"--only {unknown or only!r}: no such variant; allowed: {allowed}")
    return [v for v in runs if v.name in names or (v.seed is not None and v.group in names)]


def _train_in_subprocesses(path, out: Path, todo: list[Variant], extra, seeds, jobs: int) -> None:
    """Train ``todo`` with at most ``jobs`` ``k3train sweep --only NAME`` processes at once (small
    models on one GPU, or several CPU cores); each one's output goes to ``OUT/logs/NAME.log``."""
    import subprocess
    import sys
    import time

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    seed_args = ["--seeds", ",".join(map(str, seeds))] if seeds is not None else []
    pending, running, failed = list(todo), [], []
    out_of_memory = 0
    while pending or running:
        while pending and len(running) < jobs:
            v = pending.pop(0)
            log = open(logs / f"{v.name}.log", "w")
            cmd = [sys.executable, "-m", "k3train", "sweep", str(path), "--out", str(out), "--only", v.name,
                   *seed_args, *extra]
            print(f"[sweep] {v.name}: training in a subprocess (log {log.name})")
            running.append((v, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for item in [r for r in running if r[1].poll() is not None]:
            running.remove(item)
            item[2].close()
            if item[1].returncode != 0 or not (out / item[0].name / "DONE").is_file():
                failed.append(item[0].name)
                oom = _ran_out_of_memory(Path(item[2].name))
                out_of_memory += oom
                why = "; it ran out of GPU memory" if oom else ""
                print(f"[sweep] {item[0].name}: failed (exit {item[1].returncode}{why}); see {item[2].name}")
    if failed:
        hint = (f"; {out_of_memory} of them ran out of GPU memory with {jobs} jobs at once: rerun with a "
                f"smaller --jobs" if out_of_memory else "")
        raise RunDirError(f"sweep variants {failed} did not finish{hint}; their logs are in {logs}; rerun the "
                          f"sweep to resume them")


def _ran_out_of_memory(log: Path) -> bool:
    """Whether a variant's log ends in a device out-of-memory error (the usual failure of too
    many ``--jobs`` on one GPU)."""
    try:
        tail = log.read_bytes()[-20000:].decode(errors="replace")
    except OSError:
        return False
    return "OutOfMemoryError" in tail or "CUDA out of memory" in tail


def run_sweep(path: str | Path, out: str | Path | None = None, extra: list[str] = (),
              dry_run: bool = False, seeds: list[int] | str | None = None,
              only: list[str] | str | None = None, jobs: int = 1, collect: bool = False) -> list[dict]:
    """Run (or, with ``dry_run``, only resolve and list) every variant (once per seed when the
    file or ``seeds`` gives seeds; only those named in ``only``; ``jobs`` > 1 trains that many at
    once in subprocesses); returns the result rows. ``collect``: train nothing, tabulate the
    variants already finished in ``out`` (results brought back from other machines or runs)
    and name the ones that are not."""
    from k3train.trainer import loop  # attribute lookup at call time keeps ``loop.train`` patchable

    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    sweep = load_sweep(path)
    out = Path(out) if out is not None else Path("runs") / "sweeps" / sweep.name
    seeds = check_seeds(seeds, "--seeds") if seeds is not None else None
    runs = _select(expand_seeds(sweep, seeds), only)
    configs = [(v, variant_config(sweep, v, list(extra))) for v in runs]  # fail before any training
    tuned = {v.name: config_value(cfg, sweep.tune) for v, cfg in configs} if sweep.tune else None
    if dry_run:
        for v, cfg in configs:
            state = _done_state(out / v.name, cfg)
            print(f"{v.name:<28} {state:<7} {out / v.name}  {' '.join(v.overrides)}")
        return []
    stale = [v.name for v, cfg in configs if _done_state(out / v.name, cfg) == "stale"]
    if stale:  # before any training, so that nothing is half redone
        raise RunDirError(f"sweep variants {stale} in {out} were finished with other settings than "
                          f"this sweep resolves to (their DONE key differs); pass another --out, or "
                          f"delete those variant directories to train them again")
    todo = [v for v, _ in configs if not (out / v.name / "DONE").is_file()]
    cfg_of = {v.name: cfg for v, cfg in configs}
    if collect:
        if todo:
            print(f"[sweep] --collect: {len(todo)} of {len(configs)} variants not finished in {out}, "
                  f"left out of the tables: {', '.join(v.name for v in todo)}")
            for v in todo:
                p = unfinished_progress(v.name, cfg_of[v.name], out / v.name)
                if p:
                    print(f"[sweep]   {v.name}: logged step {p['step']} of {p['steps']}, train loss "
                          f"{_fmt(p['loss']) or '-'}, val loss {_fmt(p['val_loss']) or '-'}")
        configs = [(v, cfg) for v, cfg in configs if v not in todo]
        if not configs:
            raise RunDirError(f"--collect: no finished variant of {Path(path).name} in {out}")
        todo = []
    if jobs > 1 and len(todo) > 1:
        _train_in_subprocesses(path, out, todo, list(extra), seeds, jobs)
    rows, curves = [], {}
    for v, cfg in configs:
        run_dir = out / v.name
        if (run_dir / "DONE").is_file():
            print(f"[sweep] {v.name}: done already, skipping")
        else:
            resume = (run_dir / "checkpoints" / "latest").is_file()
            print(f"[sweep] {v.name}: {'resuming' if resume else 'training'} in {run_dir}")
            # resume=True for a new variant too: an empty directory starts at step 0, and one that a
            # killed sweep left without a checkpoint is archived first (k3train/trainer/run_dir.py).
            summary = loop.train(cfg, run_dir, resume=True)
            if summary.get("steps", 0) < cfg.train.steps:  # stopped by a signal: leave it resumable
                print(f"[sweep] {v.name} stopped at step {summary.get('steps')}; rerun the sweep to resume")
                break
            (run_dir / "DONE").write_text(json.dumps({"steps": summary.get("steps"),
                                                      "config_key": config_key(cfg)}) + "\n")
        row, records = collect_result(v.name, cfg, run_dir)
        rows.append(row)
        curves[v.name] = records
    if rows:
        out.mkdir(parents=True, exist_ok=True)
        tabulated = {r["variant"] for r in rows}
        missing = [v.name for v in runs if v.name not in tabulated]
        progress = [p for p in (unfinished_progress(n, cfg_of[n], out / n) for n in missing if n in cfg_of) if p]
        md, _ = write_results(rows, out, sweep.name, [v for v, _ in configs][:len(rows)], missing=missing,
                              tune=(sweep.tune, sweep.tune_metric, tuned) if sweep.tune else None,
                              progress=progress)
        plot_loss_curves(curves, out / "loss_curves.png")
        # MoE runs: the balance over training, not only its last value (the table's maxvio_running).
        maxvio = plot_metric_curves(curves, "moe/maxvio", out / "maxvio_curves.png", log_y=True,
                                    title="MoE MaxVio per logged step (mean over MoE layers)",
                                    ylabel="MaxVio (max load / mean load - 1)")
        print(f"[sweep] results: {md}, {out / 'results.csv'}, {out / 'loss_curves.png'}"
              + (f", {maxvio}" if maxvio else ""))
    return rows
