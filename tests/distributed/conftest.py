"""Fixtures shared by the distributed tests."""
from __future__ import annotations

import pytest

from k3train.config.schema import RunConfig
from k3train.trainer.loop import train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``reference_run(cfg)``: the run directory of the one-process run of ``cfg``, trained the
    first time a test asks for that resolved config and read from then on (several layouts are
    compared with the same run: EP=2 dynamic and static, and ZeRO-1 AdamW at DP=2, all against
    the batch of 8; EP=2 x PP=2 and PP=2 x DP=2 against 2 microbatches of 8). ``train`` seeds
    itself from the config, so the run is the one each test trained for itself before. Tests
    must only read it."""
    runs: dict[str, object] = {}

    def run(cfg: RunConfig):
        key = cfg.model_dump_json()
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("reference")
            train(cfg, runs[key])
        return runs[key]

    return run
