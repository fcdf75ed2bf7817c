"""`k3train train` at DP=2 (gloo ranks): optim.muon_distributed on and off give the same losses,
and with it on the two ranks split the Newton-Schulz blocks instead of both running all of them."""
from __future__ import annotations

import json

import pytest

import optim.muon as muon_mod
import optim.muon_distributed as md
from k3train.trainer.loop import train
from tests.distributed.helpers import STEPS, read_losses
from tests.helpers import small_cfg
from tests.multiproc import run_multiprocess


def _train_counting(rank, world, run_dir, overrides):
    """Train, counting the matrices (blocks) this rank hands to Newton-Schulz."""
    count = [0]

    def spy(real):
        def ns(G, *a, **kw):
            count[0] += G.reshape(-1, *G.shape[-2:]).shape[0]
            return real(G, *a, **kw)
        return ns

    muon_mod.newton_schulz, md.newton_schulz = spy(muon_mod.newton_schulz), spy(md.newton_schulz)
    train(small_cfg(*STEPS, *overrides), run_dir)
    (run_dir / f"ns_blocks_{rank}.json").write_text(json.dumps(count[0]))


@pytest.mark.slow  # two training runs of two gloo ranks each
def test_distributed_muon_trains_like_replicated(tmp_path):
    blocks = {}
    for flag in ("true", "false"):
        run = tmp_path / flag
        run_multiprocess(_train_counting, 2, run, ["optim.name=muon", f"optim.muon_distributed={flag}"])
        blocks[flag] = [json.loads((run / f"ns_blocks_{r}.json").read_text()) for r in range(2)]
    on, off = read_losses(tmp_path / "true"), read_losses(tmp_path / "false")
    assert len(on) == 3
    # Same per-block arithmetic (fp32 on CPU), other batches: equal to fp32 rounding.
    assert on == pytest.approx(off, rel=1e-6, abs=1e-7)
    # Replicated: both ranks orthogonalise every block; distributed: each block once, both work.
    assert blocks["false"][0] == blocks["false"][1] > 0
    assert sum(blocks["true"]) == blocks["false"][0] and min(blocks["true"]) > 0, blocks
