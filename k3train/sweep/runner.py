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
``OUT/results.csv``, ``OUT/loss_curves.png`` and, for MoE runs, ``OUT/maxvio_curves.png`` (with
seeds one line per variant, the mean over seeds, its range shaded: ``k3train.sweep.plots``);
``OUT/sweep.json`` records how the sweep was run (file, command-line overrides, seeds). A
variant in training prints a progress line about every tenth of its steps
(``k3train.sweep.progress``).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
import signal
from pathlib import Path

import yaml

from k3train.config import ConfigError, RunConfig, load_config
from k3train.errors import K3TrainError, RunDirError
# the module, not its function: ``loop.train`` looked up at call time stays patchable in tests
from k3train.trainer import loop
from k3train.runtime.files import write_text_atomic
from k3train.sweep.plots import write_sweep_plots
from k3train.sweep.progress import VariantProgress
from k3train.sweep.spec import Sweep, Variant
from k3train.sweep.results import format_cell, collect_result, unfinished_progress, write_results

__all__ = ["Sweep", "Variant", "load_sweep", "run_sweep", "collect_result", "write_results",
           "SweepStopped", "EXIT_SWEEP_STOPPED"]

# `k3train sweep`'s exit status when a stop signal (SIGTERM, SIGINT) ended it with variants left:
# distinct from 0 (done) and 2 (refused), so `k3train sweep ... && next` does not move on and a
# scheduler can requeue. docs/ablations.md documents it.
EXIT_SWEEP_STOPPED = 3


class SweepStopped(K3TrainError):
    """A stop signal ended a variant early; the sweep started no further variant. ``rows``: the
    result rows tabulated for the variants finished so far."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
# What a tuned key can be chosen by; recall is best high, the others low.
TUNE_METRICS = ("final_val_loss", "best_val_loss", "final_train_loss", "maxvio_running", "recall_acc")


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


def config_value(cfg: RunConfig, key: str):
    """The value of dotted ``key`` (``optim.lr``) in a resolved run config."""
    node = cfg
    for i, part in enumerate(key.split(".")):
        if not hasattr(node, part) or callable(getattr(node, part)):
            where = ".".join(key.split(".")[:i]) or "the run config"
            raise ConfigError(f"sweep 'tune: {key}' is not a config key ({where} has no '{part}')")
        node = getattr(node, part)
    return node


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
    models on one GPU, or several CPU cores); each one's output goes to ``OUT/logs/NAME.log``.

    A SIGTERM/SIGINT is passed on to the running variants (each saves and stops), no further
    variant starts, and ``SweepStopped`` (exit status 3) names those left once they have exited."""
    import subprocess
    import sys
    import time

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    seed_args = ["--seeds", ",".join(map(str, seeds))] if seeds is not None else []
    pending, running, failed = list(todo), [], []
    out_of_memory = 0
    stop: list[int] = []  # the signals received

    def forward(signum, frame):
        stop.append(signum)
        for _, proc, _ in running:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while pending or running:
            while pending and len(running) < jobs and not stop:
                v = pending.pop(0)
                log = open(logs / f"{v.name}.log", "w")
                cmd = [sys.executable, "-m", "k3train", "sweep", str(path), "--out", str(out), "--only", v.name,
                       *seed_args, *extra]
                print(f"[sweep] {v.name}: training in a subprocess (log {log.name})")
                running.append((v, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
            if stop and not running:
                break
            time.sleep(0.5)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                item[2].close()
                if stop and item[1].returncode == EXIT_SWEEP_STOPPED:
                    continue  # saved and stopped at the signal: left for a rerun
                if item[1].returncode != 0 or not (out / item[0].name / "DONE").is_file():
                    failed.append(item[0].name)
                    oom = _ran_out_of_memory(Path(item[2].name))
                    out_of_memory += oom
                    why = "; it ran out of GPU memory" if oom else ""
                    print(f"[sweep] {item[0].name}: failed (exit {item[1].returncode}{why}); see {item[2].name}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed:
        hint = (f"; {out_of_memory} of them ran out of GPU memory with {jobs} jobs at once: rerun with a "
                f"smaller --jobs" if out_of_memory else "")
        raise RunDirError(f"sweep variants {failed} did not finish{hint}; their logs are in {logs}; rerun the "
                          f"sweep to resume them")
    if stop:
        left = [v.name for v in todo if not (out / v.name / "DONE").is_file()]
        raise SweepStopped(f"sweep stopped by a signal ({signal.Signals(stop[0]).name}): {len(left)} variant(s) "
                           f"left ({', '.join(left)}); the running ones saved; rerun the same command to resume",
                           [])


def _ran_out_of_memory(log: Path) -> bool:
    """Whether a variant's log ends in a device out-of-memory error (the usual failure of too
    many ``--jobs`` on one GPU)."""
    try:
        tail = log.read_bytes()[-20000:].decode(errors="replace")
    except OSError:
        return False
    return "OutOfMemoryError" in tail or "CUDA out of memory" in tail


def sweep_manifest(path, sweep: Sweep, extra: list[str], seeds: list[int] | None,
                   only: list[str] | str | None) -> dict:
    """What ``OUT/sweep.json`` records and results.md's header says: the ablation file, its base
    and overrides, the command line's own overrides (after the file's, on every variant), the
    seeds and where they came from, and ``--only``."""
    return {"ablation": str(path), "name": sweep.name, "base": str(sweep.base), "file_overrides": sweep.overrides,
            "command_line_overrides": list(extra),
            "seeds": seeds if seeds is not None else sweep.seeds,
            "seeds_from": "--seeds" if seeds is not None else ("file" if sweep.seeds else None),
            "only": only if only is None or isinstance(only, str) else ",".join(only)}


def manifest_lines(manifest: dict) -> list[str]:
    """results.md's header: how the sweep was run (``sweep_manifest``)."""
    extra = " ".join(f"`{o}`" for o in manifest["command_line_overrides"]) or "none"
    seeds = (f"{', '.join(map(str, manifest['seeds']))} (from {manifest['seeds_from']})"
             if manifest["seeds"] else "none (train.seed of the config)")
    lines = [f"Ablation file `{manifest['ablation']}` (base `{manifest['base']}`, "
             f"{len(manifest['file_overrides'])} overrides of its own); "
             f"command-line overrides: {extra}; seeds: {seeds}"
             + (f"; --only {manifest['only']}" if manifest["only"] else "") + " (recorded in sweep.json)."]
    return lines


def run_sweep(path: str | Path, out: str | Path | None = None, extra: list[str] = (),
              dry_run: bool = False, seeds: list[int] | str | None = None,
              only: list[str] | str | None = None, jobs: int = 1, collect: bool = False) -> list[dict]:
    """Run (or, with ``dry_run``, only resolve and list) every variant (once per seed when the
    file or ``seeds`` gives seeds; only those named in ``only``; ``jobs`` > 1 trains that many at
    once in subprocesses); returns the result rows. ``collect``: train nothing, tabulate the
    variants already finished in ``out`` (results brought back from other machines or runs)
    and name the ones that are not."""
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
    manifest = sweep_manifest(path, sweep, list(extra), seeds, only)
    if todo and not collect:  # before training: what these runs were asked to be, even if killed
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "sweep.json", json.dumps(manifest, indent=2) + "\n")
    if collect:
        if todo:
            print(f"[sweep] --collect: {len(todo)} of {len(configs)} variants not finished in {out}, "
                  f"left out of the tables: {', '.join(v.name for v in todo)}")
            for v in todo:
                p = unfinished_progress(v.name, cfg_of[v.name], out / v.name)
                if p:
                    print(f"[sweep]   {v.name}: logged step {p['step']} of {p['steps']}, train loss "
                          f"{format_cell(p['loss']) or '-'}, val loss {format_cell(p['val_loss']) or '-'}")
        configs = [(v, cfg) for v, cfg in configs if v not in todo]
        if not configs:
            raise RunDirError(f"--collect: no finished variant of {Path(path).name} in {out}")
        todo = []
    if jobs > 1 and len(todo) > 1:
        _train_in_subprocesses(path, out, todo, list(extra), seeds, jobs)
    rows, curves, stopped = [], {}, None
    for v, cfg in configs:
        run_dir = out / v.name
        if (run_dir / "DONE").is_file():
            print(f"[sweep] {v.name}: done already, skipping")
        else:
            resume = (run_dir / "checkpoints" / "latest").is_file()
            print(f"[sweep] {v.name}: {'resuming' if resume else 'training'} in {run_dir}")
            # resume=True wherever the variant left anything: a checkpoint resumes, and a directory
            # that a killed sweep left without one is archived first (k3train/trainer/run_dir.py).
            # A fresh variant starts plainly (no "--resume: nothing to resume" line per variant).
            started = run_dir.is_dir() and any(run_dir.iterdir())
            # a line about every tenth of the run: the ablation files turn the progress bar off
            with VariantProgress(v.name, run_dir, cfg.train.steps):
                summary = loop.train(cfg, run_dir, resume=started)
            if summary.get("steps", 0) < cfg.train.steps:  # stopped by a signal: leave it resumable
                print(f"[sweep] {v.name} stopped at step {summary.get('steps')}; rerun the sweep to resume")
                stopped = (v.name, summary.get("steps"), cfg.train.steps)
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
        write_text_atomic(out / "sweep.json", json.dumps(manifest, indent=2) + "\n")
        md, _ = write_results(rows, out, sweep.name, [v for v, _ in configs][:len(rows)], missing=missing,
                              tune=(sweep.tune, sweep.tune_metric, tuned) if sweep.tune else None,
                              progress=progress, header=manifest_lines(manifest))
        # one line per variant (the mean over its seeds, their range shaded); MoE runs also the
        # balance over training, ending on the table's maxvio_running
        plots = write_sweep_plots(curves, {v.name: v.group or v.name for v, _ in configs}, out)
        print(f"[sweep] results: {md}, {out / 'results.csv'}, " + ", ".join(str(p) for p in plots.values()))
    if stopped is not None:
        finished = {r["variant"] for r in rows}
        left = [v.name for v, _ in configs if v.name not in finished]
        name, step, steps = stopped
        raise SweepStopped(f"sweep stopped by a signal: variant {name} saved at step {step} of {steps}; "
                           f"{len(left)} variant(s) left ({', '.join(left)}); rerun the same command to "
                           f"resume", rows)
    return rows
