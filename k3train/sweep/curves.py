"""The numbers a sweep reports, from one place: ``results.md``'s columns and the plotted curves
both come from ``series`` and ``spread``, so the last point of a plotted curve is the table's
cell (per run, and the mean over seeds)."""
from __future__ import annotations

import statistics
from typing import Mapping, Sequence

# results.md column -> the metrics.jsonl key whose last logged value it is (and whose curve is plotted)
FINAL_OF = {"final_train_loss": "loss", "final_val_loss": "val_loss", "maxvio_running": "moe/maxvio_running"}


def series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in a run's metrics records, in logged order (the steps that
    logged it: ``val_loss`` only at eval steps). A non-finite value stays: the table shows it."""
    pts = [(int(r["step"]), float(r[key])) for r in records
           if "step" in r and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [s for s, _ in pts], [v for _, v in pts]


def last_value(records: Sequence[dict], key: str) -> float | None:
    """The last logged value of ``key`` (a table cell), None when never logged."""
    values = series(records, key)[1]
    return values[-1] if values else None


def spread(values: Sequence[float]) -> dict:
    """``{"n", "mean", "std", "lo", "hi"}`` of one metric over seeds: the mean, the sample
    standard deviation (n-1; 0 for one value) and the range; None throughout for no values."""
    values = list(values)
    if not values:
        return {"n": 0, "mean": None, "std": None, "lo": None, "hi": None}
    return {"n": len(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "lo": min(values), "hi": max(values)}


def seed_curves(records_by_run: Mapping[str, Sequence[dict]], group_of: Mapping[str, str],
                key: str) -> dict[str, dict]:
    """Per variant (``group_of``: run name -> its variant; a run without seeds is its own), the
    curve of ``key`` over its seeds: ``{"n", "steps", "mean", "lo", "hi", "std"}`` at the
    steps every run of the variant logged (so each point averages all n seeds). Variants whose
    runs never logged ``key`` are left out."""
    groups: dict[str, list[tuple[list[int], list[float]]]] = {}
    for run, records in records_by_run.items():
        groups.setdefault(group_of.get(run, run), []).append(series(records, key))
    out = {}
    for group, runs in groups.items():
        runs = [r for r in runs if r[0]]
        if not runs:
            continue
        maps = [dict(zip(steps, values)) for steps, values in runs]
        common = sorted(set.intersection(*(set(m) for m in maps)))
        points = [spread([m[s] for m in maps]) for s in common]
        out[group] = {"n": len(runs), "steps": common, "mean": [p["mean"] for p in points],
                      "lo": [p["lo"] for p in points], "hi": [p["hi"] for p in points],
                      "std": [p["std"] for p in points]}
    return out
