"""A one-process run makes its size-1 groups without megatron-core (seconds of import a one-GPU
run would pay before its first step, k3train/runtime/distributed.py); several processes keep
megatron-core's groups (tests/distributed, tests/optim/test_muon_tp.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from k3train.runtime.distributed import (expert_group_in_force, groups_initialized, init_distributed,
                                         parallel_context, shutdown_distributed, tensor_parallel_size)

ROOT = Path(__file__).resolve().parents[2]

_RUN = """
import json, sys
from pathlib import Path
from tests.helpers import small_cfg, read_records
from k3train.trainer.loop import train
summary = train(small_cfg("train.steps=2", "train.device=cpu", "train.eval_interval=2"), Path(sys.argv[1]))
print(json.dumps({"megatron": sorted(m for m in sys.modules if m.split(".")[0] == "megatron"),
                  "val": [r["val_loss"] for r in read_records(Path(sys.argv[1])) if "val_loss" in r],
                  "checkpoints": sorted(p.name for p in (Path(sys.argv[1]) / "checkpoints").iterdir())}))
"""


def test_a_one_process_run_never_imports_megatron(tmp_path):
    """Two steps, an evaluation and the final checkpoint of a tp=1 run in a fresh interpreter:
    megatron-core stays out of ``sys.modules``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "r")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["megatron"] == []
    assert len(result["val"]) == 1 and result["checkpoints"]  # the run did evaluate and save


def test_one_process_groups_are_size_one_and_torn_down():
    info = init_distributed()
    assert groups_initialized() and tensor_parallel_size() == 1
    ctx = parallel_context(info)
    groups = [ctx.tp_group, ctx.pp_group, ctx.dp_group, ctx.ep_group, ctx.edp_group, ctx.cp_group]
    assert [dist.get_process_group_ranks(g) for g in groups] == [[0]] * 6
    assert len({id(g) for g in groups}) == 6  # one group per role, as megatron-core makes them
    assert ctx.dp_cp_group is ctx.dp_group and expert_group_in_force(1) is ctx.ep_group
    assert (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.ep_rank, ctx.cp_rank) == (0, 0, 0, 0, 0)
    shutdown_distributed()
    assert not groups_initialized() and not dist.is_initialized()
    assert expert_group_in_force(1) is None  # a meta-device builder without groups
