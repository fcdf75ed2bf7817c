"""ISSUE44 item 7 (generate): the sampling settings are checked by the library
(``k3train.infer.generate``) before anything is read: a non-finite or negative temperature, a
token count above the explicit cap, one line each; temperature 0 keeps meaning greedy."""
import pytest
import torch

from k3train.cli import main as cli_main
from k3train.errors import UsageError
from k3train.infer.generate import MAX_NEW_TOKENS, check_sampling, generate_ids


class _FixedLogits:
    """A stand-in for ``CachedModel``: the logits of each call are row ``calls`` of ``table``
    ``[steps, vocab]``, whatever the input, so the greedy reference is ``table.argmax(-1)``."""

    def __init__(self, table):
        self.table, self.calls = table, 0

    def reset(self):
        self.calls = 0

    def __call__(self, ids):
        row = self.table[self.calls]
        self.calls += 1
        return row.expand(ids.shape[0], ids.shape[1], -1)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_a_temperature_that_cannot_sample_is_one_line(tmp_path, capsys, value):
    # The checkpoint does not exist: the refusal must come first and name --temperature.
    rc = cli_main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "a", f"--temperature={value}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--temperature" in err and "finite" in err
    with pytest.raises(UsageError, match=r"^--temperature"):
        generate_ids(_FixedLogits(torch.randn(4, 7)), [1], 2, float(value), 1.0, 0, "cpu")


@pytest.mark.parametrize("count", [MAX_NEW_TOKENS + 1, 1_000_000_000, 0])
def test_max_new_tokens_is_capped(tmp_path, capsys, count):
    rc = cli_main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "a",
                   "--max-new-tokens", str(count)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"--max-new-tokens {count}" in err and "1,000,000" in err
    check_sampling(0.8, 0.95, MAX_NEW_TOKENS)  # the cap itself is allowed


def test_temperature_zero_is_still_greedy():
    table = torch.randn(6, 11)
    ids, _ = generate_ids(_FixedLogits(table), [3, 4], 6, 0.0, 1.0, 0, "cpu")
    assert ids == table.argmax(-1).tolist()
    # a small positive temperature is accepted and, this peaked, also picks the argmax
    ids, _ = generate_ids(_FixedLogits(table * 1e4), [3, 4], 6, 1e-3, 1.0, 0, "cpu")
    assert ids == table.argmax(-1).tolist()
