"""A tiktoken file whose ranks or tokens repeat is refused in one line naming the lines."""
import base64

import pytest

from k3train.data.tokenizer import TiktokenTokenizer
from k3train.errors import DataError


def _write(path, extra):
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)] + extra
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("extra, message", [
    ([f"{base64.b64encode(b'ab').decode()} 7"], "rank 7 repeats line 8"),          # rank 7 is byte 7's
    ([f"{base64.b64encode(bytes([7])).decode()} 300"], "repeats (rank 7 before)"),  # byte 7 twice
    ([f"{base64.b64encode(b'ab').decode()} -1"], "rank -1 is negative"),
], ids=["rank-twice", "token-twice", "negative"])
def test_repeated_or_negative_ranks_are_refused(tmp_path, extra, message):
    pytest.importorskip("tiktoken")
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TiktokenTokenizer(_write(tmp_path / "t.tiktoken", extra))
