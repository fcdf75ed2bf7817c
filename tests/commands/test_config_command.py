"""k3train config: the resolved config as YAML, every key with its default and doc line, an
ablation file's variants; model-info on an ablation file. Checked against the loader and the
schema themselves."""
import re

import yaml

from k3train.cli import main
from k3train.config import dump_config, load_config
from k3train.config.keys import config_keys
from k3train.config.schema import RunConfig


def test_config_prints_exactly_the_resolved_yaml(capsys):
    assert main(["config", "--config", "configs/k3_tiny.yaml", "train.steps=7", "optim.name=muon"]) == 0
    out = capsys.readouterr().out
    assert out == dump_config(load_config("configs/k3_tiny.yaml", ["train.steps=7", "optim.name=muon"]))
    tree = yaml.safe_load(out)
    assert tree["train"]["steps"] == 7 and tree["optim"]["name"] == "muon"


def test_keys_list_every_leaf_with_its_default_and_a_doc_line(capsys):
    keys = config_keys()
    defaults = RunConfig().model_dump(mode="json")
    for k in keys:  # every key resolves in the default config, and every one is documented
        node = defaults
        for part in k.key.split("."):
            node = node[part]
        assert node == (list(k.default) if isinstance(k.default, tuple) else k.default), k.key
        assert k.doc, f"{k.key} has no docstring in schema.py"
    assert main(["config", "--keys", "train"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^train\.steps +int  default 200\n +Optimizer steps of the run\.$", out, re.M)
    assert "optim.lr" not in out


def test_keys_of_an_unknown_section_is_one_line(capsys):
    assert main(["config", "--keys", "trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no such section" in err and "train" in err


def test_an_ablation_file_lists_each_variant_and_its_differences(capsys):
    assert main(["config", "--config", "configs/ablations/kda_ratio.yaml"]) == 0
    out = capsys.readouterr().out
    head, _, base = out.partition("# the base, resolved:\n")
    lines = head.strip().splitlines()
    assert lines[0].startswith("ablation configs/ablations/kda_ratio.yaml")
    variants = dict(line.strip().split(": ", 1) for line in lines[1:])
    assert variants == {"all_kda": "model.layer_pattern=K", "kkkm": "(the base)", "all_mla": "model.layer_pattern=M"}
    assert yaml.safe_load(base)["model"]["num_layers"] >= 1


def test_model_info_reads_an_ablation_file(capsys):
    assert main(["model-info", "--config", "configs/ablations/attnres.yaml"]) == 0
    out = capsys.readouterr()
    assert "unknown config key" not in out.err and "ablation configs/ablations/attnres.yaml" in out.out
    assert "model.attnres.enabled=False" in out.out.replace("false", "False")
