"""The README's first three commands are the contract with users and with CI."""
from pathlib import Path

from tests.helpers import readme_commands as _readme_commands


def test_readme_starts_with_setup_run_and_test_commands():
    text = Path("README.md").read_text()
    assert text.index("```bash") < 30, "the commands must open the README"
    setup, run, tests = _readme_commands()
    assert "pip install" in setup and run.startswith("k3train train --config configs/k3_tiny.yaml")
    assert "pytest" in tests


def test_ci_runs_exactly_the_readme_setup_and_test_commands():
    setup, _, tests = _readme_commands()
    ci = [line.strip() for line in Path(".ci/run").read_text().splitlines()]
    assert setup in ci
    assert tests in ci
