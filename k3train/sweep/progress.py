"""A sweep's progress line per variant while it trains. The ablation files turn the progress bar
off (a bar's carriage returns make a sweep's log unreadable), so the sweep follows the variant's
``metrics.jsonl`` from a thread and prints a plain line about every tenth of the run, at every
validation and at the last step:

    [sweep] block2: step 30/60 (50%), loss 2.7012, val 2.6870, 41 s, about 41 s left
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class VariantProgress:
    """Follows ``run_dir/metrics.jsonl`` of the variant ``name`` training ``steps`` steps.
    ``poll()`` prints the lines due since the last poll; as a context manager a thread polls
    every ``interval`` seconds and a last poll runs on exit."""

    def __init__(self, name: str, run_dir: Path, steps: int, *, interval: float = 2.0):
        self.name, self.path, self.steps, self.interval = name, Path(run_dir) / "metrics.jsonl", steps, interval
        self.every = max(1, steps // 10)
        # a resumed variant's earlier records were printed by the sweep that logged them
        self.printed = self._last_step()
        self.first = self.printed
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
        return out

    def _last_step(self) -> int:
        return max((r["step"] for r in self._records()), default=0)

    def line(self, record: dict) -> str:
        """The progress line of one metrics record."""
        step = record["step"]
        parts = [f"step {step}/{self.steps} ({100 * step // max(self.steps, 1)}%)"]
        if isinstance(record.get("loss"), (int, float)):
            parts.append(f"loss {record['loss']:.4f}")
        if isinstance(record.get("val_loss"), (int, float)):
            parts.append(f"val {record['val_loss']:.4f}")
        elapsed = time.monotonic() - self.start
        parts.append(f"{elapsed:.0f} s")
        done = step - self.first
        if 0 < done and step < self.steps:
            parts.append(f"about {elapsed / done * (self.steps - step):.0f} s left")
        return f"[sweep] {self.name}: " + ", ".join(parts)

    def poll(self) -> list[str]:
        """Print (and return) the lines of the records logged since the last poll that are due:
        ``every`` steps after the last printed one, a validation, or the last step."""
        lines = []
        for record in self._records():
            step = record["step"]
            if step <= self.printed:
                continue
            if step >= self.printed + self.every or "val_loss" in record or step >= self.steps:
                lines.append(self.line(record))
                self.printed = step
        for line in lines:
            print(line, flush=True)
        return lines

    def _follow(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def __enter__(self) -> "VariantProgress":
        self._thread = threading.Thread(target=self._follow, name=f"sweep-progress-{self.name}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
