"""The command table: every command is a module with HELP, add_arguments and run, whose
description (the module docstring) points at docs pages that exist; the removed modes answer
one line naming their new commands; the split export commands carry only their own options."""
import importlib
import re
from pathlib import Path

import pytest

from k3train import cli

ROOT = Path(__file__).resolve().parents[2]


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_is_a_module_whose_description_names_existing_docs(capsys, name):
    module = importlib.import_module(f"k3train.commands.{cli.COMMANDS[name]}")
    assert callable(module.add_arguments) and callable(module.run) and module.HELP
    pages = re.findall(r"docs/[\w/]+\.md", module.__doc__)
    assert pages, f"{name}: its description names no docs page"
    assert all((ROOT / p).is_file() for p in pages), pages
    out = " ".join(_help(capsys, name).split())
    assert " ".join(module.__doc__.split()[:6]) in out  # the description is what --help shows


def test_removed_export_is_hidden_and_answers_one_line(capsys, tmp_path):
    top = _help(capsys)
    assert "export-hf" in top and "export-mxfp4" in top and ",export," not in top
    assert cli.main(["export", "--checkpoint", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "export-hf" in err and "export-mxfp4" in err
    assert not (tmp_path / "o").exists()


def test_profile_pipeline_predict_names_predict_pipeline(capsys, tmp_path):
    assert "--predict" not in _help(capsys, "profile-pipeline")
    assert cli.main(["profile-pipeline", "--predict", "--config", "configs/k3_tiny.yaml",
                     "--json", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "predict-pipeline" in err


def test_export_options_are_per_format(capsys):
    hf, mx = _help(capsys, "export-hf"), _help(capsys, "export-mxfp4")
    assert "--shard-size" in hf and "--mxfp4" in hf and "--overwrite" in hf and "--format" not in hf
    assert "--shard-size" not in mx and "--mxfp4" not in mx and "--overwrite" in mx and "--format" not in mx
    assert "run directory, its checkpoints/" in " ".join(mx.split())
