"""`k3train train` at DP=2, and EP=2 x DP=4 (gloo ranks): optim.muon_distributed on and off give
the same losses, and with it on the ranks split the Newton-Schulz blocks (dense over DP, experts
over expert DP) instead of each running all of its own."""
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


@pytest.mark.slow  # two training runs of 2 (4) gloo ranks each
@pytest.mark.parametrize("world, layout", [(2, []), (4, ["parallel.ep=2"])], ids=["dp2", "ep2-dp4"])
def test_distributed_muon_trains_like_replicated(tmp_path, world, layout):
    blocks = {}
    for flag in ("true", "false"):
        run = tmp_path / flag
        run_multiprocess(_train_counting, world, run,
                         ["optim.name=muon", f"optim.muon_distributed={flag}", *layout])
        blocks[flag] = [json.loads((run / f"ns_blocks_{r}.json").read_text()) for r in range(world)]
    on, off = read_losses(tmp_path / "true"), read_losses(tmp_path / "false")
    assert len(on) == 3
    # Same per-block arithmetic (fp32 on CPU), other batches: equal to fp32 rounding.
    assert on == pytest.approx(off, rel=1e-6, abs=1e-7)
    # Replicated: every rank orthogonalises every block it holds (D dense + E of its experts).
    # Distributed: each block once per group of copies, every rank doing some.
    per_rank = blocks["false"][0]
    assert blocks["false"] == [per_rank] * world and per_rank > 0 and min(blocks["true"]) > 0, blocks
    if not layout:
        assert sum(blocks["true"]) == per_rank, blocks
    else:
        # DP=4, EP=2: the dense blocks once over 4 ranks, each expert shard once over its two
        # copies: D + 2E in all, against 4 (D + E) replicated.
        assert per_rank < sum(blocks["true"]) < 2 * per_rank, blocks
