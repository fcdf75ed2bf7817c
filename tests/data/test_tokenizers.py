"""Every tokenizer kind: round trips, meta identity, refusals, prepare-data then training.

The tokenizer files are made here (no network): a byte-level BPE trained with ``tokenizers`` on
the embedded corpus, the same BPE written as a tiktoken file, and a sentencepiece BPE.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from k3train.cli import main as cli_main
from k3train.config import load_config
from k3train.data import TokenSource, embedded_documents, load_tokenizer, prepare_data
from benchmarks.tokenizer_files import write_tiktoken, train_sentencepiece
from k3train.data.train_tokenizer import train_bpe
from k3train.errors import DataError
from k3train.trainer.data import build_data
from tests.helpers import SMALL

# Varied Unicode: accents, emoji with ZWJ sequences and skin tones, CJK, combining marks, RTL,
# NUL and other controls, surrogate-adjacent and the last code point, special-token text.
UNICODE = ["", "a", "héllo wörld", "🚀🙂 emoji 👨‍👩‍👧 👍🏽", "漢字かなカナ한국어", "e\u0301 n\u0303 combining",
           "NUL\x00byte\x01\x7f", "<|endoftext|> is text here", "  spaces\t\ttabs\r\n\n", "\ud7ff\ue000\U0010ffff",
           "שלום عربى", "def f(x):\n    return x ** 2  # ∑\n", "\u200b\ufeffzero width"]
KINDS = ["byte", "hf", "tiktoken", "sentencepiece"]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """kind -> spec for every kind, made from the embedded corpus."""
    d = tmp_path_factory.mktemp("tok")
    docs = embedded_documents()[:120]
    hf = train_bpe(docs, 400, d / "bpe")
    return {"byte": "byte", "hf": str(d / "bpe"), "tiktoken": str(write_tiktoken(hf, d / "bpe.tiktoken")),
            "sentencepiece": str(train_sentencepiece(docs, 400, d / "sp.model"))}


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_on_varied_unicode(tokenizer_files, kind):
    tok = load_tokenizer(tokenizer_files[kind])
    assert tok.kind == kind
    for s in UNICODE:
        ids = tok.encode(s)
        assert all(0 <= i < tok.vocab_size for i in ids), s
        assert tok.eod_id not in ids, f"{s!r} produced the EOD id"  # special-token text is data
        assert tok.decode(ids) == s, s
        assert tok.decode(ids + [tok.eod_id]) == s  # EOD is dropped
    if kind != "byte":  # a learned vocabulary is shorter than bytes on the text it learned from
        doc = embedded_documents()[0]
        assert len(tok.encode(doc)) < 0.8 * len(doc.encode("utf-8"))


def test_identity_is_the_files_hash_and_load_is_stable(tokenizer_files, tmp_path):
    a, b = load_tokenizer(tokenizer_files["hf"]), load_tokenizer(tokenizer_files["hf"] + "/tokenizer.json")
    assert (a.files_hash, a.vocab_size, a.eod_id) == (b.files_hash, b.vocab_size, b.eod_id)
    other = train_bpe(embedded_documents()[:60], 300, tmp_path / "other")
    assert load_tokenizer(other).files_hash != a.files_hash
    assert load_tokenizer(a.spec).encode("x y") == a.encode("x y")
    (tmp_path / "moved.json").write_bytes(open(a.spec, "rb").read())
    assert load_tokenizer(tmp_path / "moved.json").files_hash == a.files_hash  # content, not name


def test_tiktoken_special_tokens_from_tokenizer_config(tokenizer_files, tmp_path):
    src = tokenizer_files["tiktoken"]
    (tmp_path / "tiktoken.model").write_bytes(open(src, "rb").read())  # Kimi's name for the file
    n = load_tokenizer(src).eod_id
    added = {str(n): {"content": "<|im_end|>"}, str(n + 1): {"content": "<|endoftext|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok = load_tokenizer(tmp_path / "tiktoken.model")
    assert (tok.kind, tok.eod_id, tok.vocab_size) == ("tiktoken", n + 1, n + 2)  # <|endoftext|> first


def test_bad_tokenizer_specs_say_what_is_allowed(tmp_path, monkeypatch):
    import sys

    with pytest.raises(DataError, match="unknown tokenizer 'gpt2' .*tiktoken BPE file"):
        load_tokenizer("gpt2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "few.tiktoken").write_bytes(b"YQ== 0\nYg== 1\n")
    with pytest.raises(DataError, match="lacks 254 of the 256 single-byte tokens"):
        load_tokenizer(tmp_path / "few.tiktoken")
    (tmp_path / "t.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match=r"needs the 'tokenizers' package.*pip install 'k3train\[tokenizers\]'"):
        load_tokenizer(tmp_path / "t.json")


def test_train_tokenizer_command_writes_a_loadable_bpe(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("the cat sat on the mat " * 50)
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "the dog sat on the log " * 50}) + "\n")
    assert cli_main(["train-tokenizer", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--text-key", "body",
                     "--vocab-size", "300", "--out", str(tmp_path / "tok")]) == 0
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.kind == "hf" and 257 < tok.vocab_size <= 300 and tok.eod_id == 0
    assert len(tok.encode(" the cat sat")) < len(" the cat sat")  # merges were learned
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["train-tokenizer", "--vocab-size", "100", "--out", str(tmp_path / "t2"),
                     "--corpus", "embedded"]) == 2
    assert "--vocab-size 100 is too small" in capsys.readouterr().err


def _prepare_and_build(tmp_path, spec, *extra):
    """prepare-data (CLI) on three documents, then the run's data -> (tokenizer, prefix, data)."""
    docs = embedded_documents()[:30]
    with open(tmp_path / "d.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    prefix = tmp_path / "ds"
    assert cli_main(["prepare-data", str(tmp_path / "d.jsonl"), "--output-prefix", str(prefix),
                     "--tokenizer", spec]) == 0
    return docs, prefix


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_end_to_end_prepare_then_train(tokenizer_files, kind, tmp_path):
    from k3train.trainer.loop import train

    tok = load_tokenizer(tokenizer_files[kind])
    docs, prefix = _prepare_and_build(tmp_path, tokenizer_files[kind])
    meta = json.loads((tmp_path / "ds.meta.json").read_text())
    assert (meta["tokenizer_kind"], meta["tokenizer_files_hash"]) == (tok.kind, tok.files_hash)
    assert (meta["vocab_size"], meta["eod_id"]) == (tok.vocab_size, tok.eod_id)
    # Independent reference: the tokenizer applied to each document, EOD after each.
    ref = np.concatenate([np.asarray(tok.encode(d) + [tok.eod_id]) for d in docs])
    got = TokenSource.from_prefix(prefix, tok, "all").tokens
    np.testing.assert_array_equal(got, ref)
    # data.tokenizer unset: the meta file's tokenizer is used. A fresh model's loss is about
    # ln(model.vocab_size): the vocabulary reached the embedding and the loss.
    vocab = 512
    cfg = load_config("configs/k3_tiny.yaml", [*SMALL, "train.steps=3", "train.log_interval=1",
                                               f"data.source={prefix}", f"model.vocab_size={vocab}"])
    summary = train(cfg, tmp_path / "run")
    assert abs(summary["first_loss"] - math.log(vocab)) < 0.5
    assert math.isfinite(summary["last_loss"])


def test_training_refuses_another_tokenizer_and_a_small_vocab(tokenizer_files, tmp_path):
    _, prefix = _prepare_and_build(tmp_path, "byte")
    cfg = load_config(None, [f"data.source={prefix}", f"data.tokenizer={tokenizer_files['hf']}",
                             "model.vocab_size=512"])
    with pytest.raises(DataError, match=r"prepared with tokenizer 'byte' \(byte.* but this run uses 'hf:tokenizer.json'"):
        build_data(cfg)
    cfg = load_config(None, [f"data.tokenizer={tokenizer_files['sentencepiece']}", "model.vocab_size=320"])
    with pytest.raises(DataError, match=r"model.vocab_size=320 is smaller than the vocabulary of tokenizer "
                                        r"'sentencepiece:sp.model' \(400\)"):
        build_data(cfg)


def test_foreign_megatron_dataset_trains_when_its_tokenizer_is_named(tokenizer_files, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = load_tokenizer(tokenizer_files["hf"])
    docs = embedded_documents()[:20]
    builder = IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for d in docs:  # written by megatron-core's own builder, with EOD, and no k3train meta file
        builder.add_document(np.asarray(tok.encode(d) + [tok.eod_id], dtype=np.uint16), [len(tok.encode(d)) + 1])
    builder.finalize(str(tmp_path / "meg.idx"))
    prefix = str(tmp_path / "meg")
    ref = np.concatenate([tok.encode(d) + [tok.eod_id] for d in docs])

    with pytest.raises(DataError, match="no meg.meta.json .*name its tokenizer with data.tokenizer"):
        build_data(load_config(None, [f"data.source={prefix}"]))
    with pytest.raises(DataError, match="outside \\[0, 257\\) of data.tokenizer 'byte'"):
        build_data(load_config(None, [f"data.source={prefix}", "data.tokenizer=byte"]))
    with pytest.raises(DataError, match="model.vocab_size=320 is smaller"):
        build_data(load_config(None, [f"data.source={prefix}", f"data.tokenizer={tokenizer_files['hf']}"]))
    cfg = load_config(None, [f"data.source={prefix}", f"data.tokenizer={tokenizer_files['hf']}",
                             "model.vocab_size=448", "train.seq_len=16", "train.micro_batch_size=2"])
    data = build_data(cfg)
    batch = next(data.train).numpy()
    # Each row is a window of the reference stream.
    starts = [np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ref, 17) == row, axis=1))
              for row in batch]
    assert all(len(s) for s in starts)


@pytest.mark.slow
def test_trained_tokenizer_short_run_learns(tmp_path):
    from k3train.trainer.loop import train

    path = train_bpe(embedded_documents(), 512, tmp_path / "tok")
    with open(tmp_path / "d.jsonl", "w") as f:
        for d in embedded_documents():
            f.write(json.dumps({"text": d}) + "\n")
    prepare_data([tmp_path / "d.jsonl"], tmp_path / "ds", load_tokenizer(path))
    cfg = load_config("configs/k3_tiny.yaml", [*SMALL, "train.steps=40", "train.log_interval=1",
                                               "optim.warmup_steps=5", f"data.source={tmp_path / 'ds'}",
                                               "model.vocab_size=512"])
    summary = train(cfg, tmp_path / "run")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Step 1 is about ln(512) = 6.2. The margin is about 4x the step-to-step noise of the
    # loss (about 0.2 nats), and the mean of the last five steps damps that noise further.
    assert losses[0] > 5.5
    assert np.mean(losses[-5:]) < losses[0] - 0.8
    assert summary["val_loss"] < losses[0] - 0.6


@pytest.mark.parametrize("kind, name", [("sentencepiece", "tokenizer.model.v3"), ("hf", "tokenizer.json.v2"),
                                        ("tiktoken", "vocab.v1")])
def test_a_tokenizer_file_under_a_versioned_name_loads_by_its_content(tokenizer_files, tmp_path, kind, name):
    src = Path(tokenizer_files[kind])
    src = src / "tokenizer.json" if src.is_dir() else src
    renamed = tmp_path / name
    renamed.write_bytes(src.read_bytes())
    tok, ref = load_tokenizer(renamed), load_tokenizer(src)
    assert tok.kind == kind and tok.encode("ship it, 1 2 3") == ref.encode("ship it, 1 2 3")


def test_a_file_of_no_known_kind_is_one_line(tmp_path):
    junk = tmp_path / "tok.bin"
    junk.write_bytes(b"\x00\x01garbage")
    with pytest.raises(DataError, match="cannot tell which kind of tokenizer"):
        load_tokenizer(junk)
