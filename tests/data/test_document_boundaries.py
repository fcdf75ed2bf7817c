"""Document boundaries of packed windows (``data.document_mask``), checked against the token
stream directly: the boundaries are where the stream's EOD tokens are, every token of every
document stays a target exactly once per epoch, each seen only with its own document, and a
dataset that marks no documents is refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from k3train.config import load_config
from k3train.data.dataset import BatchIterator, SequenceDataset, TokenSource
from k3train.data.documents import window_documents
from k3train.errors import DataError
from k3train.trainer.data import build_data

EOD = 256


def _stream(n_docs: int, seed: int) -> np.ndarray:
    """doc EOD doc EOD ... with distinct non-EOD ids (so a target names its stream position)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, n_docs)
    out, next_id = [], 1000
    for n in lengths:
        out.extend(range(next_id, next_id + n))
        out.append(EOD)
        next_id += n
    return np.asarray(out, dtype=np.int64)


def test_boundaries_are_the_eod_tokens_and_the_row_starts():
    ds = SequenceDataset(TokenSource(_stream(60, 0), vocab_size=5000), seq_len=16)
    w = ds.batch(np.arange(len(ds)))
    cu = window_documents(w, EOD)
    want = [r * 16 + t for r in range(len(w)) for t in range(16) if t == 0 or int(w[r, t]) == EOD]
    assert cu.tolist() == want + [len(w) * 16]
    assert cu.dtype == torch.int64


def test_every_document_token_is_a_target_once_per_epoch_and_sees_only_its_document():
    seq, batch = 12, 4
    stream = _stream(80, 1)
    stream = stream[:len(stream) // (seq * batch) * seq * batch + 1]   # whole batches: no tail dropped
    ds = SequenceDataset(TokenSource(stream, vocab_size=5000), seq_len=seq)
    steps = len(ds) // batch
    it = BatchIterator(ds, batch, seed=3)
    # the stream's document index of each position: as an input an EOD opens the next
    # document; as a target it closes its own
    eods = np.cumsum(stream == EOD)
    input_doc = eods
    target_doc = np.concatenate([[0], eods[:-1]])
    seen = []
    for _ in range(steps):
        w = next(it)
        cu = window_documents(w, EOD).tolist()
        starts = set(cu[:-1])
        for r, row in enumerate(w.numpy()):
            # the window's place in the stream, from its distinct ids
            first = row[0] if row[0] != EOD else row[1]
            pos0 = int(np.flatnonzero(stream == first)[0]) - (0 if row[0] != EOD else 1)
            assert (stream[pos0:pos0 + seq + 1] == row).all()
            for t in range(seq):
                p = pos0 + t + 1            # stream position of the target of input t
                seen.append(p)
                s = max(u for u in range(t + 1) if r * seq + u in starts)   # its segment's start
                context = range(pos0 + s, pos0 + t + 1)
                assert all(input_doc[i] == target_doc[p] for i in context)
                # and the segment reaches back to the document's start (or the window's)
                assert s == 0 or stream[pos0 + s] == EOD
    assert it.epoch == 0
    # one epoch: every target position once, in the windows' range of the stream
    assert sorted(seen) == list(range(1, len(ds) * seq + 1))


def _foreign(tmp_path, with_eod: bool) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        doc = list(rng.integers(0, 256, 30)) + ([EOD] if with_eod else [])
        builder.add_document(np.asarray(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(str(tmp_path / "meg.idx"))
    return str(tmp_path / "meg")


def test_a_dataset_without_document_marks_is_refused_in_one_line(tmp_path):
    prefix = _foreign(tmp_path, with_eod=False)
    base = [f"data.source={prefix}", "data.tokenizer=byte", "train.seq_len=16", "train.micro_batch_size=2"]
    with pytest.raises(DataError) as err:
        build_data(load_config(None, base))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("data.document_mask=true needs document boundaries")
    assert "set data.document_mask=false" in msg and prefix in msg
    data = build_data(load_config(None, [*base, "data.document_mask=false"]))
    assert data.documents(next(data.train)) is None


def test_marked_datasets_and_mqar(tmp_path):
    prefix = _foreign(tmp_path / "", with_eod=True)
    data = build_data(load_config(None, [f"data.source={prefix}", "data.tokenizer=byte", "train.seq_len=16",
                                         "train.micro_batch_size=2"]))
    w = next(data.train)
    assert data.documents(w).tolist() == window_documents(w, EOD).tolist()
    # MQAR windows are one sequence each: nothing to mask, nothing refused
    cfg = load_config(None, ["data.source=mqar"])
    assert cfg.data.document_mask and not cfg.data.masks_documents
    assert "data.document_mask" not in cfg.cuda_graph_blockers(device="cuda")
    assert "data.document_mask" in load_config(None, ["train.seq_len=16384"]).cuda_graph_blockers(device="cuda")
