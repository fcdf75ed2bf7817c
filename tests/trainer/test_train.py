"""End-to-end CPU training: loss falls, resume is bit-exact, run directory contents, CLI."""
import json

import pytest
import torch
import yaml

from k3train.cli import main as cli_main
from k3train.config import load_config
from k3train.errors import K3TrainError
from k3train.trainer.checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint
from k3train.trainer.loop import train
from k3train.trainer.state_io import consolidated_state
from tests.helpers import SMALL, small_cfg, read_records


def test_tiny_run_learns_and_writes_run_dir(tmp_path):
    cfg = small_cfg("train.steps=40", "train.log_interval=5", "train.eval_interval=20", "optim.warmup_steps=5",
                    "train.plots=true")
    summary = train(cfg, tmp_path)
    recs = read_records(tmp_path)
    assert [r["step"] for r in recs] == list(range(5, 41, 5))
    for key in ("step", "loss", "lr", "tokens_per_s", "grad_norm", "matmul_util", "moe/maxvio"):
        assert key in recs[0]
    assert 0 < recs[-1]["matmul_util"] < 1 and "mfu" not in recs[-1]  # a CPU has no datasheet peak
    for png in ("loss.png", "expert_load.png", "attnres_depth.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG", png
    # Byte-level text starts near ln(320) = 5.77 nats; 40 steps must cut well below that.
    assert summary["first_loss"] > 5.0
    assert recs[-1]["loss"] < summary["first_loss"] - 1.5
    assert recs[-1]["val_loss"] < 4.2
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 40
    verify_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), world_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("optim_name", ["adamw", "muon"])
def test_resume_equals_uninterrupted_bit_for_bit(tmp_path, optim_name):
    extra = ["train.steps=6", "train.log_interval=1", "train.microbatches=2", f"optim.name={optim_name}"]
    full, split = tmp_path / "full", tmp_path / "split"
    train(small_cfg(*extra), full)
    train(small_cfg(*extra), split, stop_at=3)
    train(small_cfg(*extra), split, resume=True)
    assert [r["loss"] for r in read_records(full)] == [r["loss"] for r in read_records(split)]
    # The load tracker is checkpointed: the running MaxVio continues instead of restarting.
    running = [[r["moe/maxvio_running"] for r in read_records(d)] for d in (full, split)]
    assert running[0] == running[1]
    a, b = (consolidated_state(latest_checkpoint(d / "checkpoints")) for d in (full, split))
    assert a["model"].keys() == b["model"].keys() and a["optim"].keys() == b["optim"].keys()
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for name, moments in a["optim"].items():
        assert all(torch.equal(v, b["optim"][name][k]) for k, v in moments.items()), name
    data = [torch.load(latest_checkpoint(d / "checkpoints") / "rank_00000.pt", weights_only=False)["data"]
            for d in (full, split)]
    assert data[0] == data[1]


def test_corrupted_checkpoint_is_refused(tmp_path):
    train(small_cfg("train.steps=2"), tmp_path)
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    shard = ckpt / "rank_00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank_00000.pt is corrupted"):
        train(small_cfg("train.steps=4"), tmp_path, resume=True)


def test_resume_refuses_a_different_parallel_layout_for_an_old_format_checkpoint(tmp_path):
    """Checkpoints stored by global name reshard (tests/distributed/test_reshard.py); the older
    per-rank format (no tensor index in the manifest) still only resumes under its own layout."""
    from k3train.trainer.checkpoint import CheckpointError

    train(small_cfg("train.steps=2"), tmp_path)
    manifest = latest_checkpoint(tmp_path / "checkpoints") / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["tensors"]  # the older format
    data["layout"]["pp"] = 2  # as if the run had been launched with parallel.pp=2
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"different parallel layout: pp=2 \(now 1\)"):
        train(small_cfg("train.steps=4"), tmp_path, resume=True)


def test_cli_prepare_data_then_train(tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * 40})
                                for i in range(60)))
    prefix = tmp_path / "data" / "docs"
    assert cli_main(["prepare-data", str(corpus), "--output-prefix", str(prefix)]) == 0
    run = tmp_path / "run"
    overrides = [*SMALL, "train.steps=3", f"data.source={prefix}"]
    assert cli_main(["train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(run), *overrides]) == 0
    assert len(read_records(run)) == 1
    assert "data: TokenSource" in capsys.readouterr().out


def test_cli_bad_input_is_one_clear_line(tmp_path, capsys):
    assert cli_main(["train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(tmp_path), "optim.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr: Input should be greater than 0" in err and "Traceback" not in err
    assert cli_main(["train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(tmp_path / "v"),
                     "model.vocab_size=100", *SMALL]) == 2
    assert "model.vocab_size=100 is smaller than the vocabulary of tokenizer 'byte' (257)" in capsys.readouterr().err


def test_grad_norm_and_clip_match_per_tensor_reference():
    """global_grad_norm (one foreach norm per category) and clip_grads_ against the plain
    per-tensor sums, with fp32 and bf16 gradients, a parameter without a gradient and a clip
    that bites (through DataParallelGrads, the replicated optimizer's path, with no groups)."""
    from optim.grads import DataParallelGrads, GradGroups

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 5), (3,), (4, 4)]]
    params.append(torch.nn.Parameter(torch.randn(2, 9, dtype=torch.bfloat16)))
    for i, p in enumerate(params):
        if i != 1:
            p.grad = torch.randn_like(p) * (i + 1)
    want = sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None).sqrt()
    grads = DataParallelGrads(params, groups=GradGroups())
    norm = grads.global_grad_norm()
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(want.item(), rel=1e-6)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    grads.clip_grads_(norm, 1.0)
    for p, b in zip(params, before):
        if b is not None:
            torch.testing.assert_close(p.grad.float(), (b.float() * (1.0 / (norm + 1e-6))).to(b.dtype).float(),
                                       rtol=1e-2 if b.dtype == torch.bfloat16 else 1e-6, atol=1e-6)


def test_cuda_graph_refuses_a_cpu_device(world1):
    # train.device=auto resolves to the CPU here: the config cannot know, the trainer must say so.
    from k3train.runtime.distributed import init_distributed
    from k3train.trainer.state import TrainState

    cfg = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=true", "train.device=auto", "data.document_mask=false"])
    with pytest.raises(ValueError, match="train.cuda_graph needs a CUDA device, this run is on cpu"):
        TrainState(cfg, init_distributed(device="cpu"), torch.device("cpu"))


def test_cuda_graph_auto_turns_on_exactly_where_supported():
    from types import SimpleNamespace

    from k3train.trainer.state import use_cuda_graph

    cuda, cpu, one, two = torch.device("cuda"), torch.device("cpu"), SimpleNamespace(dp=1), SimpleNamespace(dp=2)
    auto = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto", "data.document_mask=false"])
    assert use_cuda_graph(auto, one, cuda) and use_cuda_graph(auto, two, cuda)   # DP: reduced after the replay
    assert not use_cuda_graph(auto, one, cpu)
    # document masking (the default) is recorded in a fixed shape below 16K tokens, auto and true
    # alike; from 16K MLA reads each batch's boundaries on the host: auto leaves the graph off,
    # true is refused
    assert use_cuda_graph(load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto"]), one, cuda)
    assert use_cuda_graph(load_config("configs/k3_tiny.yaml", ["train.cuda_graph=true"]), one, cuda)
    assert not use_cuda_graph(load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto", "train.seq_len=16384"]),
                              one, cuda)
    with pytest.raises(K3TrainError, match="16384"):   # refused when the config loads
        load_config("configs/k3_tiny.yaml", ["train.cuda_graph=true", "train.seq_len=16384"])
    unmasked = ["train.cuda_graph=auto", "data.document_mask=false"]
    for override in ("parallel.pp=2", "precision.recipe=fp8", "precision.recipe=mxfp8"):
        assert use_cuda_graph(load_config("configs/k3_tiny.yaml", [*unmasked, override]), one, cuda)
    static_ep = load_config("configs/k3_tiny.yaml", [*unmasked, "parallel.ep=2", "moe.capacity_factor=1.25"])
    assert use_cuda_graph(static_ep, one, cuda)
    for override in ("parallel.ep=2", "parallel.tp=2"):
        assert not use_cuda_graph(load_config("configs/k3_tiny.yaml", [*unmasked, override]), one, cuda)
    assert use_cuda_graph(load_config(None, ["data.document_mask=false"]), one, cuda)    # the default is auto
    assert not use_cuda_graph(load_config(None, ["train.cuda_graph=false", "data.document_mask=false"]), one, cuda)
    on = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=true", "data.document_mask=false"])
    assert use_cuda_graph(on, two, cuda)


def test_expert_grad_scale_without_a_group_scales_in_place():
    """One rank: no flatten/all-reduce round trip; the tensors themselves are scaled (or left
    exactly as they are for a scale of 1)."""
    from optim.grads import allreduce_sum_then_scale

    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 4, 5, generator=gen), torch.randn(7, generator=gen)]
    before = [t.clone() for t in ts]
    allreduce_sum_then_scale(ts, None, 1.0)
    assert all(torch.equal(t, b) for t, b in zip(ts, before))
    allreduce_sum_then_scale(ts, None, 0.25)
    for t, b in zip(ts, before):
        torch.testing.assert_close(t, b * 0.25, rtol=0, atol=0)


def _one_step_params(overrides: list[str]) -> tuple[list[torch.Tensor], float]:
    from k3train.runtime.distributed import init_distributed
    from k3train.trainer.state import TrainState

    cfg = load_config("configs/k3_tiny.yaml", ["model.num_layers=4", "train.seq_len=32",
                                               "train.micro_batch_size=2", *overrides])
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device="cpu"), torch.device("cpu"))
    batch = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    stats = state.train_step(batch)
    return [p.detach().clone() for p in state.params], stats["grad_norm"]


def test_clip_applies_exactly_when_the_norm_exceeds_the_limit(world1):
    """train_step skips the clip pass when clip_'s factor would be 1: a limit far above the
    norm gives bit-identical weights to clipping off (grad_clip=0), and a limit below the norm
    changes them."""
    off, norm = _one_step_params(["train.grad_clip=0"])
    loose, _ = _one_step_params([f"train.grad_clip={norm * 100}"])
    tight, _ = _one_step_params([f"train.grad_clip={norm / 100}"])
    assert all(torch.equal(a, b) for a, b in zip(off, loose))
    assert any(not torch.equal(a, b) for a, b in zip(off, tight))


def test_schedule_lr_warms_up_then_decays_every_group(world1):
    """TrainState.schedule_lr (what the loop and the benchmarks call before a step) against the
    schedule written out: linear warm-up (step / warmup), then cosine to min_lr_ratio, on every
    optimizer group (Muon's and AdamW's) relative to that group's own base rate."""
    import math

    from k3train.runtime.distributed import init_distributed
    from k3train.trainer.state import TrainState

    cfg = small_cfg("optim.name=muon", "optim.lr=1e-3", "optim.warmup_steps=4", "train.steps=12",
               "optim.schedule=cosine", "optim.min_lr_ratio=0.1")
    state = TrainState(cfg, init_distributed(device="cpu"), torch.device("cpu"))
    groups = state.optimizer.param_groups
    base = [g["lr"] for g in groups]
    assert len(groups) >= 2
    for step in range(1, 13):
        if step <= 4:
            factor = step / 4
        else:
            t = (step - 4) / (12 - 4)
            factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
        assert state.schedule_lr(step) == pytest.approx(1e-3 * factor)
        for g, b in zip(groups, base):
            assert g["lr"] == pytest.approx(b * factor), step
