"""``k3train env`` / ``--version``, and the rule that every dependency has a tested upper bound."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from k3train.runtime import env_report
from k3train.cli import main


def _pyproject_requirements() -> list[str]:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]


def test_every_dependency_is_bounded_above_and_listed_by_env():
    reqs = _pyproject_requirements()
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in reqs}
    assert names == {name for name, _ in env_report.PACKAGES}, "env's package list and pyproject differ"
    unbounded = [r for r in reqs if "<" not in r.split(";")[0]]
    assert not unbounded, f"no upper bound: {unbounded}"
    doc = Path("docs/dependencies.md").read_text()
    missing = [n for n in names if f"| {n} |" not in doc and f"| `{n}` |" not in doc]
    assert not missing, f"docs/dependencies.md has no row for {missing}"


@pytest.mark.parametrize("have, spec, want", [("2.13.0+cpu", "<2.14,>=2.11", True), ("2.14.0", "<2.14,>=2.11", False),
                                              ("2.10.9", "<2.14,>=2.11", False), ("0.16.1", "<0.17,>=0.16", True),
                                              ("1.0", "", True)])
def test_in_range(have, spec, want):
    assert env_report.in_range(have, spec) is want


def test_declared_ranges_strip_extras_and_markers(monkeypatch):
    monkeypatch.setattr(env_report.metadata, "requires", lambda name: [
        "torch<2.14,>=2.11", 'transformer-engine[pytorch]<3,>=2.0; extra == "te"',
        'triton<3.10,>=3.6; sys_platform == "linux" and extra == "dev"', "pyyaml"])
    assert env_report.declared_ranges() == {"torch": "<2.14,>=2.11", "transformer-engine": "<3,>=2.0",
                                            "triton": "<3.10,>=3.6", "pyyaml": ""}


def test_ranges_come_from_pyproject_when_k3train_is_not_installed(monkeypatch):
    def not_installed(name):
        raise env_report.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(env_report.metadata, "requires", not_installed)
    ranges = env_report.declared_ranges()
    assert ranges["torch"] == "<2.14,>=2.11" or set(ranges["torch"].split(",")) == {">=2.11", "<2.14"}
    assert "<" in ranges["transformer-engine"] and "<" in ranges["triton"]


def test_rows_flag_missing_and_out_of_range_packages(monkeypatch):
    versions = {"torch": "2.15.0", "numpy": "2.4.6"}

    def fake_version(name):
        if name in versions:
            return versions[name]
        raise env_report.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(env_report.metadata, "version", fake_version)
    monkeypatch.setattr(env_report, "declared_ranges", lambda: {"torch": "<2.14,>=2.11", "numpy": "<2.6,>=1.26"})
    rows = {r["name"]: r for r in env_report.dependency_rows()}
    assert rows["torch"]["status"] == "OUTSIDE the tested range"
    assert rows["numpy"]["status"] == "ok"
    assert rows["pydantic"]["status"] == "not installed (required)"
    assert rows["torchao"]["status"] == "not installed (extra 'gpu')"


def test_env_command_reports_versions_devices_and_every_kernel_family(capsys):
    from k3train.ops import kernels

    assert main(["env", "--config", "configs/k3_tiny.yaml", "kernels.short_conv=torch"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"k3train {env_report.version()} (commit ")
    assert re.search(r"^  torch\s+2\.\d+\.\d+\S*\s+<2\.14,>=2\.11\s+ok$", out, re.M), out
    assert "CUDA: not available" in out or "CUDA: 1" in out
    for family in kernels.FAMILIES:
        assert re.search(rf"^  {family}\s+torch\b", out, re.M), family  # CPU column: always torch
    # --config's kernels section reached the report: the CUDA column shows the override.
    assert re.search(r"^  short_conv\s+torch\s+torch$", out, re.M), out


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert re.fullmatch(r"k3train \d+\.\d+\.\d+\S* \(commit (\w+(\+dirty)?|unknown)\)\n", capsys.readouterr().out)
