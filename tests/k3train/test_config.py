"""Config loading: shipped configs validate, overrides apply, bad input names the field."""
from pathlib import Path

import pytest
import yaml

from k3train.config import ConfigError, load_config, save_config
from k3train.model.layout import expand_layer_pattern

CONFIGS = sorted(Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_validate(path):
    load_config(path)


def test_overrides_parse_yaml_scalars():
    cfg = load_config("configs/k3_tiny.yaml", ["train.steps=7", "optim.lr=1e-4", "model.attnres.enabled=false",
                                               "optim.name=muon"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-4
    assert cfg.model.attnres.enabled is False and cfg.optim.name == "muon"


@pytest.mark.parametrize("override, message", [
    (["model.hiden_size=3"], "unknown config key 'model.hiden_size'; allowed keys here: attnres"),
    (["optim.name=sgd"], "optim.name: Input should be 'adamw' or 'muon'"),
    (["train.steps=0"], "train.steps: Input should be greater than or equal to 1"),
    (["moe.topk=8"], "moe.topk (8) must be smaller than moe.num_experts (8)"),
    (["model.layer_pattern=KKX"], "term 'KKX' of 'KKX' is not letters K/M"),
    (["model.num_layers=6"], "does not tile model.num_layers=6"),
    (["precision.recipe=fp4"], "precision.recipe: Input should be"),
    (["precision.recipe=mxfp4_qat", "moe.latent_size=48"], "{'moe.latent_size': 48} must be multiples of 32"),
    (["train.steps"], "is not of the form key.sub=value"),
    (["train.steps.x=1"], "'steps' is a value, not a section"),
    (["train.cuda_graph=true", "parallel.pp=2"], "(got {'parallel.pp': 2})"),
    (["train.cuda_graph=true", "train.device=cpu"], "a CUDA device (train.device=cpu)"),
    (["train.cuda_graph=true", "precision.recipe=fp8"], "precision.recipe bf16 or fp32 (got fp8)"),
], ids=["unknown-key", "bad-enum", "range", "cross-field", "pattern-letter", "pattern-length",
        "recipe", "mx-block", "no-equals", "value-as-section", "graph-pp", "graph-cpu", "graph-recipe"])
def test_bad_input_names_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/k3_tiny.yaml", override)
    assert message in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("configs/k3_tiny.yaml", ["train.steps=3"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 3


def test_stable_user_config_keys_exist():
    keys = ["train.steps", "train.seed", "train.microbatches", "parallel.tp", "parallel.pp", "parallel.vpp",
            "parallel.ep", "model.attnres.enabled", "model.attnres.block_size", "model.layer_pattern",
            "moe.balancing", "optim.name", "precision.recipe", "checkpoint.interval"]
    dumped = load_config(None).model_dump()
    for key in keys:
        node = dumped
        for part in key.split("."):
            node = node[part]


@pytest.mark.parametrize("pattern, n, expected", [
    ("KKKM", 8, "KKKMKKKM"), ("KKKM*2+KKM", 11, "KKKMKKKMKKM"), ("M", 3, "MMM"),
])
def test_layer_pattern_expansion(pattern, n, expected):
    assert "".join(expand_layer_pattern(pattern, n)) == expected


def test_full_k3_pattern_is_69_kda_24_mla_ending_in_mla():
    cfg = load_config("configs/k3_full.yaml")
    layers = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    assert layers.count("K") == 69 and layers.count("M") == 24 and layers[-1] == "M"
