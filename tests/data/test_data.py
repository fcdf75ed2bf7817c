"""k3train.data: tokenizer, prepare_data -> TokenSource round trip, error messages, batching."""

import json
import os

import numpy as np
import pytest
import torch

from k3train.errors import DataError
from k3train.data import (
    BatchIterator,
    ByteTokenizer,
    SequenceDataset,
    TokenSource,
    embedded_documents,
    eval_batches,
    get_tokenizer,
    prepare_data,
)

TEXTS = ["Hello, world.\nSecond line.", "Grüße aus Köln — naïve café ☕ 漢字 🚀", "x"]


@pytest.fixture
def tok():
    return ByteTokenizer()


@pytest.fixture
def prepared(tmp_path, tok):
    """Two .txt documents and a .jsonl with three records (one empty, skipped) -> prefix."""
    (tmp_path / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    (tmp_path / "b.txt").write_text(TEXTS[1], encoding="utf-8")
    with open(tmp_path / "c.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": TEXTS[2], "id": 1}) + "\n\n")
        f.write(json.dumps({"text": "", "id": 2}) + "\n")
        f.write(json.dumps({"text": "last one", "id": 3}) + "\n")
    inputs = [tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.jsonl"]
    prefix = tmp_path / "out" / "ds"
    stats = prepare_data(inputs, prefix, tok)
    return prefix, stats, TEXTS + ["last one"]


def test_tokenizer_round_trip(tok):
    for text in TEXTS + ["", "\x00\t\r\n"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode("é")) == 2  # non-ASCII costs several byte tokens
    assert tok.decode(tok.encode("ab") + [tok.eod_id] + tok.encode("c")) == "abc"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # truncated UTF-8 is replaced, not an error
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])
    assert (tok.vocab_size, tok.eod_id, tok.name) == (257, 256, "byte")
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2' .*allowed: 'byte', a Hugging Face"):
        get_tokenizer("gpt2")


def test_prepare_round_trip(prepared, tok):
    prefix, stats, docs = prepared
    # Independent reference: encode the inputs directly, EOD after every document.
    ref = []
    for d in docs:
        ref += list(d.encode("utf-8")) + [256]
    assert stats["num_documents"] == 4 and stats["num_tokens"] == len(ref)
    assert (stats["tokenizer"], stats["vocab_size"], stats["dtype"]) == ("byte", 257, "uint16")
    meta = json.loads((prefix.parent / "ds.meta.json").read_text())
    assert meta["num_tokens"] == len(ref)
    assert sorted(os.listdir(prefix.parent)) == ["ds.bin", "ds.idx", "ds.meta.json"]  # no temp left

    train = TokenSource.from_prefix(prefix, tok, "train", val_fraction=0.25)
    val = TokenSource.from_prefix(prefix, tok, "val", val_fraction=0.25)
    got = np.concatenate([train.tokens, val.tokens]).tolist()
    assert got == ref
    assert len(val) == len(ref) - int(len(ref) * 0.75)

    # Megatron's own reader sees one document per input document.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    assert [tok.decode(ds[i]) for i in range(len(ds))] == docs


def test_tokenizer_mismatch_rejected(prepared, tok):
    prefix, _, _ = prepared

    class OtherTokenizer(ByteTokenizer):
        name = "other"
        files_hash = "another-byte-table"

    with pytest.raises(ValueError, match="prepared with tokenizer 'byte'.*uses 'other'"):
        TokenSource.from_prefix(prefix, OtherTokenizer())


def test_truncated_and_missing_files_detected(prepared, tok):
    prefix, _, _ = prepared
    bin_path = prefix.parent / "ds.bin"
    data = bin_path.read_bytes()
    bin_path.write_bytes(data[:-3])
    with pytest.raises(ValueError, match="ds.bin is truncated or corrupt"):
        TokenSource.from_prefix(prefix, tok)
    bin_path.unlink()
    with pytest.raises(DataError, match="ds.bin is missing"):
        TokenSource.from_prefix(prefix, tok)
    bin_path.write_bytes(data)
    (prefix.parent / "ds.meta.json").unlink()
    with pytest.raises(DataError, match="did not finish"):
        TokenSource.from_prefix(prefix, tok)


def test_prepare_input_errors(tmp_path, tok):
    out = tmp_path / "o"
    (tmp_path / "d.csv").write_text("a,b\n")
    allowed = r"allowed: \.txt, \.jsonl, \.parquet"
    with pytest.raises(ValueError, match=r"d\.csv has unsupported extension '\.csv'; " + allowed):
        prepare_data([tmp_path / "d.csv"], out, tok)
    with pytest.raises(DataError, match="input file not found: .*nope.txt"):
        prepare_data([tmp_path / "nope.txt"], out, tok)
    (tmp_path / "e.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"e\.jsonl:2: no field 'text' \(found: \['body'\]\)"):
        prepare_data([tmp_path / "e.jsonl"], out, tok)
    assert not list(tmp_path.glob("o*"))  # the failed run left nothing behind
    (tmp_path / "f.jsonl").write_text('{"body": "text lives here"}\n')
    assert prepare_data([tmp_path / "f.jsonl"], out, tok, text_key="body")["num_documents"] == 1
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no non-empty documents found in inputs: .*empty.txt"):
        prepare_data([tmp_path / "empty.txt"], tmp_path / "o2", tok)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, tok, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"needs pyarrow.*pip install 'k3train\[parquet\]'"):
        prepare_data([tmp_path / "d.parquet"], tmp_path / "o", tok)


def _toy_dataset(n_tokens=1000, seq_len=8):
    tokens = np.arange(n_tokens, dtype=np.int64) % 257
    return SequenceDataset(TokenSource(tokens, 257, "toy"), seq_len)


def test_sequence_dataset_windows():
    ds = _toy_dataset(n_tokens=100, seq_len=8)
    assert len(ds) == (100 - 1) // 8
    w = ds[3]
    assert w.dtype == torch.long and w.shape == (9,)
    assert w.tolist() == list(range(24, 33))
    assert torch.equal(ds.batch([3, 0]), torch.stack([ds[3], ds[0]]))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_batch_iterator_resume_is_exact():
    ds = _toy_dataset()  # 124 windows: 5 + 5 batches of 16 cross an epoch boundary
    it = BatchIterator(ds, batch_size=16, seed=7)
    first = [next(it) for _ in range(5)]
    state = it.state_dict()
    assert set(state) == {"epoch", "position", "seed"}
    rest = [next(it) for _ in range(5)]
    assert all(b.shape == (16, 9) and b.dtype == torch.long for b in first + rest)
    assert it.epoch >= 1

    fresh = BatchIterator(ds, batch_size=16, seed=0)  # seed comes from the state
    fresh.load_state_dict(state)
    for a, b in zip(rest, (next(fresh) for _ in range(5))):
        assert torch.equal(a, b)
    # A different seed gives a different order.
    assert not torch.equal(next(BatchIterator(ds, 16, seed=8)), first[0])


def test_data_parallel_ranks_are_disjoint_slices_of_global_batch():
    ds = _toy_dataset()
    whole = BatchIterator(ds, batch_size=8, seed=3, world_size=1)
    r0 = BatchIterator(ds, batch_size=4, seed=3, rank=0, world_size=2)
    r1 = BatchIterator(ds, batch_size=4, seed=3, rank=1, world_size=2)
    for _ in range(20):  # crosses epochs
        g, a, b = next(whole), next(r0), next(r1)
        assert torch.equal(torch.cat([a, b]), g)
        starts_a, starts_b = set(a[:, 0].tolist()), set(b[:, 0].tolist())
        assert not starts_a & starts_b
    assert r0.state_dict() == r1.state_dict() == whole.state_dict()


def test_eval_batches_fixed_and_in_order():
    ds = _toy_dataset()
    batches = eval_batches(ds, batch_size=4, max_batches=3)
    assert len(batches) == 3
    assert torch.equal(torch.cat(batches), ds.batch(range(12)))
    assert all(torch.equal(x, y) for x, y in zip(batches, eval_batches(ds, 4, 3)))
    assert len(eval_batches(ds, 100, 5)) == 5 - 4  # 124 windows -> one full batch of 100
    assert eval_batches(ds, 1000, 2)[0].shape == (len(ds), 9)


def test_embedded_corpus_split(tok):
    docs = embedded_documents()
    assert len(docs) > 50 and docs == embedded_documents()
    train = TokenSource.embedded(tok, "train")
    val = TokenSource.embedded(tok, "val")
    total = sum(len(d.encode("utf-8")) + 1 for d in docs)
    assert len(train) + len(val) == total > 400_000
    assert len(val) == total - int(total * 0.95) > 20_000
    # Train and val are consecutive, non-overlapping parts of one stream.
    stream = np.concatenate([train.tokens, val.tokens])
    assert int((stream == tok.eod_id).sum()) == len(docs)
    assert tok.decode(stream[: len(docs[0].encode()) + 1].tolist()) == docs[0]
    assert SequenceDataset(val, 256).__len__() > 50


@pytest.mark.parametrize("bad_id", [300, 400], ids=["between-tokenizer-and-model-vocab", "past-model-vocab"])
def test_token_ids_outside_the_vocabulary_are_refused_when_opened(prepared, tok, bad_id):
    # The byte tokenizer has 257 ids (uint16 on disk); k3_tiny's model has 320 rows. 400 used to
    # end in an IndexError inside the embedding, 300 trained silently on rows no text produces.
    prefix, _, _ = prepared
    bin_path = prefix.parent / "ds.bin"
    tokens = np.fromfile(bin_path, dtype=np.uint16)
    tokens[7] = bad_id
    tokens.tofile(bin_path)
    with pytest.raises(DataError, match=rf"ds\.bin holds token id {bad_id} at position 7, outside the "
                                        rf"vocabulary \[0, {tok.vocab_size}\)"):
        TokenSource.from_prefix(prefix, tok)


def test_token_range_check_samples_long_streams(monkeypatch):
    from k3train.data import dataset as ds_mod

    monkeypatch.setattr(ds_mod, "_FULL_SCAN_TOKENS", 100)
    monkeypatch.setattr(ds_mod, "_SAMPLES", 3)
    monkeypatch.setattr(ds_mod, "_SAMPLE_TOKENS", 10)
    tokens = np.zeros(1000, dtype=np.uint16)
    tokens[500] = 999  # the middle sample is [495, 505) (linspace over 0..990)
    tokens[996] = 257  # in the last chunk: found
    with pytest.raises(DataError, match="token id 999 at position 500"):
        ds_mod.check_token_range(tokens, 257, "stream")
    tokens[500] = 0
    with pytest.raises(DataError, match="token id 257 at position 996"):
        ds_mod.check_token_range(tokens, 257, "stream")
    tokens[996] = 256  # the largest valid id (the byte tokenizer's EOD) passes
    ds_mod.check_token_range(tokens, 257, "stream")


def test_prepare_removes_temporaries_of_killed_runs_only(tmp_path, tok):
    import subprocess

    from k3train.data.prepare import _this_host

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has exited
    out, host = tmp_path / "out", _this_host()
    out.mkdir()
    stale = [out / f"ds.tmp{gone.pid}-{host}.bin", out / f"ds.tmp{gone.pid}-{host}.meta.json",
             out / f"ds.tmp{gone.pid}.idx"]  # the last: the name older versions wrote
    kept = [out / f"ds.tmp{os.getppid()}-{host}.bin",  # a live writer (pytest's parent)
            out / f"ds.tmp{gone.pid}-otherhost.bin",  # another host's, on a shared filesystem
            out / f"ds2.tmp{gone.pid}-{host}.bin"]  # another prefix
    for p in stale + kept:
        p.write_bytes(b"x" * 64)
    (tmp_path / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    prepare_data([tmp_path / "a.txt"], out / "ds", tok)
    assert [p for p in stale if p.exists()] == []
    assert all(p.exists() for p in kept)
    assert len(TokenSource.from_prefix(out / "ds", tok)) > 0
