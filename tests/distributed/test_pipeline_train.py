"""`k3train train` with the pipeline engine (gloo ranks) follows the single-process run."""
import json

import pytest
import torch

import k3train.trainer.report as report
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.loop import train
from tests.helpers import small_cfg
from tests.multiproc import run_multiprocess
from tests.distributed.helpers import STEPS, read_losses, train_rank


@pytest.mark.parametrize("overrides, world", [
    (["parallel.pp=2", "parallel.vpp=2", "train.microbatches=2"], 2),
    (["parallel.pp=2", "train.microbatches=3", "model.attnres.enabled=false"], 2),
    # p2p_backend=gloo: the messages travel on separate gloo groups, one per pipeline (two here).
    (["parallel.pp=2", "parallel.vpp=2", "train.microbatches=2", "pipeline.attnres_transport=naive",
      "pipeline.p2p_backend=gloo"], 4),
], ids=["pp2-vpp2-cached", "pp2-standard-residual", "pp2-dp2-naive-gloo-groups"])
@pytest.mark.slow
def test_pipeline_training_matches_single_process(tmp_path, overrides, world, reference_run):
    base = [o for o in overrides if not o.startswith(("parallel.", "pipeline."))]
    dp = world // 2
    ref_overrides = [*base, f"train.micro_batch_size={4 * dp}"] if dp > 1 else base
    ref_dir = reference_run(small_cfg(*STEPS, *ref_overrides))
    run_multiprocess(train_rank, world, tmp_path / "pp", overrides)
    ref, got = read_losses(ref_dir), read_losses(tmp_path / "pp")
    assert len(ref) == len(got) == 3
    # fp32; gradients sum in a different order, and three AdamW steps amplify that a little.
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    first = json.loads((tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["pipeline/bytes_sent"] > 0 and first["pipeline/peak_cache_bytes"] >= 0


@pytest.mark.slow
def test_checkpoint_survives_a_data_parallel_resize(tmp_path, capsys):
    """Saved by DP=2 (two gloo ranks), resumed by one process: the replicated state loads."""
    run_multiprocess(train_rank, 2, tmp_path, ["train.steps=4"])
    summary = train(small_cfg(*STEPS, "train.steps=6"), tmp_path, resume=True, stop_at=5)
    assert "resumed from" in capsys.readouterr().out and summary["steps"] == 5
    manifest = json.loads((latest_checkpoint(tmp_path / "checkpoints") / "manifest.json").read_text())
    assert manifest["optim_step"] == 5, "the optimizer state of the DP=2 run must have been loaded"


MOE_STEPS = ["train.steps=2", "train.log_interval=1", "train.eval_interval=2", "train.microbatches=2",
             "train.plots=true"]  # the plots test below reads what the end-of-run heatmaps draw


def _save_plot_inputs(run_dir):
    """Wrap the two heatmap writers so the matrix and weights they draw are saved next to the
    PNGs (the test compares the data, not the pixels)."""
    draw_loads, draw_depth = report.plot_expert_load_heatmap, report.plot_attnres_depth_heatmap

    def loads(mat, path, *args, **kwargs):
        torch.save(mat, run_dir / "expert_load.pt")
        return draw_loads(mat, path, *args, **kwargs)

    def depth(weights, path, *args, **kwargs):
        torch.save(list(weights), run_dir / "attnres_depth.pt")
        return draw_depth(weights, path, *args, **kwargs)

    return loads, depth


def _train_rank_saving_plots(rank, world_size, run_dir, overrides):
    report.plot_expert_load_heatmap, report.plot_attnres_depth_heatmap = _save_plot_inputs(run_dir)
    train(small_cfg(*MOE_STEPS, *overrides), run_dir)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """The one-process run with its plot inputs saved, once per reference config for the module
    (pp2-vpp2 and tp2 share theirs); the tests only read it."""
    runs: dict = {}

    def run(ref_overrides: list[str]):
        key = tuple(ref_overrides)
        if key not in runs:
            ref = runs[key] = tmp_path_factory.mktemp("moe-ref")
            loads, depth = _save_plot_inputs(ref)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(report, "plot_expert_load_heatmap", loads)
                mp.setattr(report, "plot_attnres_depth_heatmap", depth)
                train(small_cfg(*MOE_STEPS, *ref_overrides), ref)
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("overrides, ref_overrides, same_val_batch", [
    (["parallel.pp=2", "parallel.vpp=2"], [], True),
    (["parallel.tp=2"], [], True),
    # EP=2 is DP=2: the reference sees both ranks' micro-batches as one of 8; the depth plot
    # uses the main rank's validation batch, half of the reference's.
    (["parallel.ep=2"], ["train.micro_batch_size=8"], False),
], ids=["pp2-vpp2", "tp2", "ep2"])
def test_moe_metrics_and_plots_cover_every_rank(tmp_path, moe_reference, overrides, ref_overrides,
                                                same_val_batch):
    """Two ranks. pp=2, vpp=2: one layer per chunk, rank 0 holds MoE layer 1 (chunk 2), rank 1
    MoE layers 0 and 2 (chunks 1 and 3); tp/ep=2: the AttnRes forward needs both ranks. The
    logged moe/* metrics, the expert load heatmap and the AttnRes depth heatmap must cover
    every layer, as the one-process run does (under PP they covered rank 0's layers only, and
    attnres_depth.png was written under none of the three)."""
    ref, run = moe_reference(ref_overrides), tmp_path / "run"
    run_multiprocess(_train_rank_saving_plots, 2, run, overrides)
    want, got = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
                 for d in (ref, run)]
    assert len(want) == len(got) == 2
    for w, g in zip(want, got):
        moe_keys = sorted(k for k in w if k.startswith("moe/"))
        assert {f"moe/maxvio/layer{i}" for i in range(3)} <= set(moe_keys)
        assert sorted(k for k in g if k.startswith("moe/")) == moe_keys
        # Same weights at step 1, fp32 sums in another order after it: routing counts agree.
        assert [g[k] for k in moe_keys] == pytest.approx([w[k] for k in moe_keys], rel=1e-6)
    assert torch.equal(torch.load(run / "expert_load.pt"), torch.load(ref / "expert_load.pt"))
    w_ref, w_run = torch.load(ref / "attnres_depth.pt"), torch.load(run / "attnres_depth.pt")
    assert len(w_run) == len(w_ref) == 2 * 4 + 1     # mixer and FFN of each layer, then the final
    if same_val_batch:
        for a, b in zip(w_run, w_ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for png in ("expert_load.png", "attnres_depth.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG", png
