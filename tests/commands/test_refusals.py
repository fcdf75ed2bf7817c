"""One-line refusals: the CLI prints every K3TrainError as ``k3train: error: ...`` and keeps the
traceback of everything else."""
import pytest

from k3train.cli import main as cli_main
from k3train.config import ConfigError
from k3train.errors import CheckpointError, DataError, K3TrainError, LayoutError, TrainingStopped
from tests.helpers import SMALL

TRAIN = ["train", "--config", "configs/k3_tiny.yaml", *SMALL]


def test_error_types_keep_their_old_bases():
    # ConfigError and the kinds that replaced ValueErrors are still ValueErrors (callers that
    # caught ValueError keep working); all are K3TrainErrors, which the CLI prints in one line.
    for cls in (ConfigError, DataError, LayoutError):
        assert issubclass(cls, K3TrainError) and issubclass(cls, ValueError)
    assert issubclass(CheckpointError, K3TrainError) and issubclass(TrainingStopped, K3TrainError)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.vpp=2"], "parallel.vpp=2 needs parallel.pp > 1"),
    (["parallel.tp=2", "parallel.ep=2"], "parallel.ep=2 together with parallel.tp=2 is not supported"),
])
def test_layouts_megatron_would_refuse_are_one_line(tmp_path, capsys, overrides, message):
    # Before: megatron-core's RuntimeError (vpp with pp=1) or its group set-up failing, with a traceback.
    rc = cli_main([*TRAIN, "--run-dir", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("k3train: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_internal_value_error_keeps_its_traceback(tmp_path, monkeypatch):
    # A ValueError from inside the trainer is a bug, not bad input: it must not be flattened
    # into "k3train: error: ..." (the old handler caught every ValueError).
    import k3train.trainer.loop as loop

    def broken(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(loop, "train", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        cli_main([*TRAIN, "--run-dir", str(tmp_path / "run")])
