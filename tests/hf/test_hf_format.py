"""Hugging Face export/import: the round trip is bitwise (every tensor, and the logits of the
model rebuilt from the imported config), MXFP4-packed experts import as their fake-quantised
values, and damaged directories are refused with one line naming the file or tensor."""
from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import k3train.hf
from k3train.cli import build_parser, main
from k3train.config import RunConfig, load_config
from k3train.trainer.run_dir import save_config
from k3train.errors import CheckpointError
from k3train.hf.load import load_hf, merge_model_config
from k3train.model.model import build_model
from k3train.quant.mx import fake_quant_mx
from k3train.trainer.checkpoint import save_checkpoint

# 4 layers KKKM, layer 0 dense, AttnRes on, untied head; expert sizes divisible by 32 (MXFP4 blocks).
TINY = ["model.hidden_size=64", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=32",
        "model.kda.chunk_size=16", "model.mla.num_heads=2", "model.mla.q_lora_rank=32",
        "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8",
        "model.mla.v_head_dim=16", "model.ffn.intermediate_size=96", "moe.num_experts=4", "moe.topk=2",
        "moe.latent_size=32", "moe.expert_ffn_size=64", "moe.shared_ffn_size=64", "train.device=cpu"]


def _cfg(*extra) -> RunConfig:
    return load_config("configs/k3_tiny.yaml", [*TINY, *extra])


def _random_model(cfg):
    """The model with every tensor (buffers too: the router bias) drawn at random, so a swapped
    or transposed tensor cannot go unnoticed."""
    model = build_model(cfg)
    with torch.no_grad():
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.2)
    return model


def _run_dir(tmp_path, cfg, model):
    """A run directory as training leaves it: config.yaml + a one-process checkpoint."""
    run = tmp_path / "run"
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "checkpoints", 3, {"step": 3, "model": model.state_dict()},
                    layout={"world_size": 1}, coords={"pp": 0, "tp": 0, "ep": 0, "dp": 0})
    return run


def _cli(*argv):
    args = build_parser().parse_args(list(argv))
    return args.fn(args)


def _export(tmp_path, world1, *extra, cfg_extra=()):
    cfg = _cfg(*cfg_extra)
    model = _random_model(cfg)
    run = _run_dir(tmp_path, cfg, model)
    out = tmp_path / "hf"
    assert _cli("export-hf", "--checkpoint", str(run / "checkpoints"), "--out", str(out),
                *extra) == 0
    return cfg, model, out


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_bitwise_tensors_and_logits(tmp_path, world1, tied):
    cfg, model, out = _export(tmp_path, world1, "--shard-size", "40KB",
                              cfg_extra=[f"model.tie_embeddings={str(tied).lower()}"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for f in shards:  # each shard within the limit, unless one tensor alone is bigger
        held = load_file(str(out / f))
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) <= 40_000, f
    assert (out / shards[0]).stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    assert (out / "modeling_k3train.py").read_bytes() == \
        (Path(k3train.hf.__file__).parent / "remote_code" / "modeling_k3train.py").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] and config["model_type"] and config["num_hidden_layers"] == 4
    assert config["linear_attn_config"]["full_attn_layers"] == [4]
    assert json.loads((out / "tokenizer_config.json").read_text())["k3train_tokenizer"] == "byte"
    # HF names and layouts where the architecture matches Kimi Linear / DeepSeek-V3.
    wm = index["weight_map"]
    assert "model.layers.0.self_attn.q_conv1d.weight" in wm and "model.layers.3.self_attn.kv_b_proj.weight" in wm
    assert ("lm_head.weight" in wm) is not tied
    e = load_file(str(out / wm["model.layers.2.mlp.experts.3.down_proj.weight"]))
    assert torch.equal(e["model.layers.2.mlp.experts.3.down_proj.weight"],
                       model.state_dict()["layers.2.ffn.experts.w_down"][3].t())

    model_cfg, state = load_hf(out)
    want = model.state_dict()
    assert list(state) == list(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
    rebuilt_cfg = merge_model_config(RunConfig(), model_cfg)
    assert rebuilt_cfg.model == cfg.model and rebuilt_cfg.moe == cfg.moe
    rebuilt = build_model(rebuilt_cfg)
    rebuilt.load_state_dict(state)
    tokens = torch.randint(0, 257, (2, 40))  # crosses the 16-token KDA chunks
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens), model(tokens))


def test_import_writes_a_checkpoint_the_trainer_reads(tmp_path, world1):
    cfg, model, out = _export(tmp_path, world1)
    run = tmp_path / "imported"
    assert _cli("import", str(out), "--out", str(run)) == 0
    from k3train.trainer.checkpoint import verify_checkpoint
    from k3train.trainer.state_io import consolidated_state, load_weights

    step_dir = run / "checkpoints" / "step_00000000"
    saved = consolidated_state(step_dir, optimizer=False)
    assert load_config(run / "config.yaml").model == cfg.model
    for name, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(saved["model"][name], value), name
    # what train.init_from does: the pieces by global name into a freshly built model
    fresh = build_model(cfg)
    load_weights(fresh, step_dir, verify_checkpoint(step_dir, 1, None), 1, 0)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    # ... and exporting the imported checkpoint again gives the same files' tensors.
    again = tmp_path / "hf2"
    assert _cli("export-hf", "--checkpoint", str(run / "checkpoints"), "--out", str(again)) == 0
    a, b = load_file(str(out / "model-00001-of-00001.safetensors")), load_file(
        str(again / "model-00001-of-00001.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mxfp4_packed_experts_import_dequantised(tmp_path, world1):
    cfg, model, out = _export(tmp_path, world1, "--mxfp4")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    # transformers cannot read packed experts: no remote code is offered for them
    assert "auto_map" not in config and not (out / "modeling_k3train.py").exists()
    wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight.mx_codes" in wm
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in wm
    _, state = load_hf(out)
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        if ".ffn.experts." in name:
            # The reference: the QAT fake-quantiser along the reduction axis (dim 1 of [E, in, out]).
            ref = fake_quant_mx(value.transpose(1, 2), "e2m1").transpose(1, 2)
            assert torch.equal(state[name], ref), name
            assert not torch.equal(state[name], value)
        else:
            assert torch.equal(state[name], value), name


def _one_line(exc_info, *words):
    msg = str(exc_info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_refusals_name_the_file_or_tensor(tmp_path, world1, capsys):
    cfg, model, out = _export(tmp_path, world1, "--shard-size", "40KB")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    # a shape mismatch
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    shard = out / index["weight_map"][name]
    tensors = load_file(str(shard))
    original = dict(tensors)
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError) as e:
        load_hf(out)
    _one_line(e, name, "shape [63, 32]", "[64, 32]")
    save_file(original, str(shard))
    # a tensor the index names but its shard lacks
    index["weight_map"]["model.layers.0.self_attn.bogus.weight"] = index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        load_hf(out)
    _one_line(e, "model.layers.0.self_attn.bogus.weight", str(shard))
    del index["weight_map"]["model.layers.0.self_attn.bogus.weight"]
    index_path.write_text(json.dumps(index))
    # a missing shard
    shard.rename(shard.with_suffix(".bak"))
    with pytest.raises(CheckpointError) as e:
        load_hf(out)
    _one_line(e, str(shard), "missing")
    shard.with_suffix(".bak").rename(shard)
    load_hf(out)  # intact again: nothing above damaged the directory for good
    # a missing index
    index_path.unlink()
    with pytest.raises(CheckpointError) as e:
        load_hf(out)
    _one_line(e, "model.safetensors.index.json")
    # the CLI prints it as one line, exit status 2, no traceback, and writes nothing
    assert main(["import", str(out), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3train: error: ") and "\n" not in err and "model.safetensors.index.json" in err
    assert not (tmp_path / "x").exists()


def test_export_modes_are_two_commands_and_the_old_spelling_says_so(tmp_path, capsys):
    # The hf-only options are not options of export-mxfp4 at all: argparse refuses them.
    with pytest.raises(SystemExit) as exc:
        main(["export-mxfp4", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"), "--mxfp4"])
    assert exc.value.code == 2 and "unrecognized arguments: --mxfp4" in capsys.readouterr().err
    # The former spelling answers one line naming both commands, and writes nothing.
    for fmt in ("hf", "mxfp4-packed"):
        assert main(["export", "--checkpoint", str(tmp_path), "--format", fmt, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "'k3train export-hf'" in err and "'k3train export-mxfp4'" in err
    assert not (tmp_path / "o").exists()
    assert main(["export-hf", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--shard-size", "5 parsecs"]) == 2
    assert "--shard-size '5 parsecs' is not a size" in capsys.readouterr().err


def test_kimi_linear_layout_is_refused_in_one_line_by_the_cli(tmp_path, world1, capsys):
    cfg = _cfg()
    run = _run_dir(tmp_path, cfg, build_model(cfg))
    assert main(["export-hf", "--checkpoint", str(run), "--out", str(tmp_path / "kl"), "--layout", "kimi_linear"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3train: error: export-hf --layout kimi_linear: this model does not fit") and "\n" not in err
    assert "KDA forget gate" in err and not (tmp_path / "kl").exists()


def test_export_copies_the_runs_tokenizer_files(tmp_path, world1):
    """A run with a trained BPE (data.tokenizer=DIR) exports that tokenizer.json byte for byte,
    and tokenizer_config.json names its kind, hash, vocabulary size and EOD id."""
    import json

    from k3train.data.tokenizer import load_tokenizer
    from k3train.data.train_tokenizer import train_bpe

    tok_dir = tmp_path / "tok"
    train_bpe(["the cat sat on the mat. " * 20, "a dog ran; the dog sat."] * 5, 300, tok_dir)
    tok = load_tokenizer(str(tok_dir))
    cfg, _, out = _export(tmp_path, world1, cfg_extra=[f"data.tokenizer={tok_dir}", f"model.vocab_size={tok.vocab_size}"])
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    meta = json.loads((out / "tokenizer_config.json").read_text())
    assert (meta["k3train_tokenizer_kind"], meta["k3train_tokenizer_hash"], meta["vocab_size"], meta["eos_token_id"]) \
        == ("hf", tok.files_hash, tok.vocab_size, tok.eod_id)
    assert load_tokenizer(str(out / "tokenizer.json")).files_hash == tok.files_hash


@pytest.mark.slow
def test_init_from_an_hf_directory_equals_init_from_its_import(tmp_path, world1):
    """train.init_from=HF_DIR loads the same weights as importing it first: the first losses of
    the two fine-tunes are equal (bitwise on CPU), and a model of other widths is refused in one
    line naming the differing field."""
    from k3train.errors import UsageError
    from k3train.trainer.loop import train

    cfg, _, out = _export(tmp_path, world1, "--dtype", "float32")
    run = tmp_path / "imported"
    assert _cli("import", str(out), "--out", str(run)) == 0
    steps = ["train.steps=1", "train.log_interval=1", "train.eval_interval=100", "logging.progress_bar=false",
             "logging.wandb.mode=disabled"]
    a = train(_cfg(*steps, f"train.init_from={out}"), tmp_path / "a")
    b = train(_cfg(*steps, f"train.init_from={run}"), tmp_path / "b")
    fresh = train(_cfg(*steps), tmp_path / "c")
    assert a["first_loss"] == b["first_loss"] != fresh["first_loss"]
    with pytest.raises(UsageError, match=r"describes another model \(model\.hidden_size"):
        train(_cfg(*steps, "model.hidden_size=48", f"train.init_from={out}"), tmp_path / "d")
