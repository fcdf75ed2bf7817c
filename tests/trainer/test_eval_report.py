"""``k3train eval`` says what it evaluated (split, batches, tokens) and the trainer's banner how
many batches its val_loss covers; both counts against the validation batches built independently."""
import re

import pytest

from k3train.cli import main as cli_main
from k3train.trainer.data import build_data
from k3train.trainer.loop import train
from tests.helpers import read_records, small_cfg

STEPS = ["train.steps=2", "train.log_interval=1", "train.eval_interval=2", "train.eval_batches=3"]


def _val(*overrides):
    """The validation batches of the run's config with ``overrides`` (each [windows, seq_len + 1])."""
    return build_data(small_cfg(*STEPS, *overrides)).val


def _counts(line: str) -> tuple[int, int]:
    m = re.search(r": (\d+) batches of \d+ windows x \d+ tokens = ([\d,]+) tokens$", line)
    return int(m.group(1)), int(m.group(2).replace(",", ""))


@pytest.mark.slow
def test_eval_and_banner_say_what_they_evaluated(tmp_path, capsys):
    train(small_cfg(*STEPS), tmp_path)
    banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[k3train] data:"))
    three = _val()
    assert len(three) == 3
    assert (f"val loss over 3 batches, {sum(b[:, 1:].numel() for b in three):,} tokens "
            f"(train.eval_batches=3; k3train eval covers the whole split)") in banner

    # --batches 3: the trainer's batches, so its val_loss (the whole split's differs)
    assert cli_main(["eval", "--checkpoint", str(tmp_path), "--batches", "3", "logging.progress_bar=false"]) == 0
    first, numbers = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "the first 3 batches of the validation split (--batches) of data.source=embedded" in first
    assert _counts(first) == (3, 3 * 4 * 32)  # micro_batch_size 4, seq_len 32
    assert float(numbers.split("|")[0].split()[-1]) == pytest.approx(read_records(tmp_path)[-1]["val_loss"], abs=1e-4)

    # the default: the whole split, counted from the batches built here
    whole = _val("train.eval_batches=1000000")
    assert len(whole) > 3
    assert cli_main(["eval", "--checkpoint", str(tmp_path), "logging.progress_bar=false"]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-2]
    assert "the whole validation split of data.source=embedded" in first
    assert _counts(first) == (len(whole), sum(b[:, 1:].numel() for b in whole))
