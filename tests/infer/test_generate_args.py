"""generate's sampling arguments are checked before any checkpoint is opened: one line each."""
import pytest

from k3train.cli import main


@pytest.mark.parametrize("flag, value, words", [
    ("--temperature", "nan", "expected a finite number >= 0"), ("--temperature", "inf", "expected a finite"),
    ("--temperature", "-1", "expected a finite"), ("--top-p", "0", "expected 0 < top-p <= 1"),
    ("--top-p", "nan", "expected 0 < top-p"), ("--max-new-tokens", "1000000000", "expected 1 to 100,000"),
    ("--max-new-tokens", "0", "expected 1 to"),
])
def test_bad_sampling_arguments_are_one_line(tmp_path, capsys, flag, value, words):
    missing = tmp_path / "no_such_run"
    assert main(["generate", "--checkpoint", str(missing), "--prompt", "hi", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err and "no_such_run" not in err
