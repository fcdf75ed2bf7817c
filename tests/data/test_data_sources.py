"""prepare-data options, weighted mixtures (data.sources) and the stdlib corpus."""
import hashlib
import json

import numpy as np
import pytest

from k3train.cli import main as cli_main
from k3train.config import load_config
from k3train.data import ByteTokenizer, SequenceDataset, TokenSource, prepare_data
from k3train.data import stdlib_corpus
from k3train.data.mixture import MixtureBatchIterator
from k3train.errors import DataError
from k3train.trainer.data import build_data

TOK = ByteTokenizer()


def _docs_of(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [TOK.decode(ds[i]) for i in range(len(ds))]


def test_txt_is_one_document_unless_split(tmp_path):
    (tmp_path / "a.txt").write_text("line one\nline two\n\npara two\n  \n\n\nthird\n")
    prepare_data([tmp_path / "a.txt"], tmp_path / "whole", TOK)
    assert _docs_of(tmp_path / "whole") == ["line one\nline two\n\npara two\n  \n\n\nthird\n"]
    prepare_data([tmp_path / "a.txt"], tmp_path / "lines", TOK, txt_split="lines")
    assert _docs_of(tmp_path / "lines") == ["line one", "line two", "para two", "  ", "third"]  # empty skipped
    assert cli_main(["prepare-data", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "par"),
                     "--split-blank-lines"]) == 0
    assert _docs_of(tmp_path / "par") == ["line one\nline two", "para two", "third\n"]
    with pytest.raises(SystemExit):  # the two splits exclude each other
        cli_main(["prepare-data", str(tmp_path / "a.txt"), "--output-prefix", "x", "--split-lines",
                  "--split-blank-lines"])


def test_text_key_errors_name_the_flag(tmp_path, capsys):
    (tmp_path / "e.jsonl").write_text('{"body": "x"}\n')
    assert cli_main(["prepare-data", str(tmp_path / "e.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no field 'text' (found: ['body']); pass --text-key" in err


def test_parquet_input_reads_the_text_key_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one", None, "two 🙂", ""], "id": [1, 2, 3, 4]}), tmp_path / "d.parquet")
    prepare_data([tmp_path / "d.parquet"], tmp_path / "o", TOK, text_key="body")
    assert _docs_of(tmp_path / "o") == ["one", "two 🙂"]  # null and empty rows skipped
    with pytest.raises(DataError, match=r"no column 'text' \(found: \['body', 'id'\]\); pass --text-key"):
        prepare_data([tmp_path / "d.parquet"], tmp_path / "o2", TOK)


def test_prepare_help_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        cli_main(["prepare-data", "--help"])
    out = capsys.readouterr().out
    for word in ("'byte'", "tokenizer.json", "tiktoken", "sentencepiece", ".jsonl", ".parquet", "--split-lines",
                 "--split-blank-lines", "--workers", "{auto,on,off}"):
        assert word in out, word


@pytest.mark.slow  # two spawned processes import torch: about 10 s on two shared cores
def test_workers_give_the_same_files_as_one_process(tmp_path):
    docs = [f"document {i} " + "é🙂x" * (i % 17) for i in range(400)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    import k3train.data.prepare as prep

    one = prepare_data([tmp_path / "d.jsonl"], tmp_path / "one", TOK, workers=1)
    chunk = prep._CHUNK_CHARS
    prep._CHUNK_CHARS = 500  # many chunks, so the two workers interleave
    try:
        two = prepare_data([tmp_path / "d.jsonl"], tmp_path / "two", TOK, workers=2)
    finally:
        prep._CHUNK_CHARS = chunk
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()
    assert one["num_tokens"] == two["num_tokens"] == sum(len(d.encode()) + 1 for d in docs)


def test_progress_bar_shows_documents_tokens_and_bytes_per_second(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello\nworld\n")
    prepare_data([tmp_path / "a.txt"], tmp_path / "o", TOK, progress=True, txt_split="lines")
    err = capsys.readouterr().err
    assert "2 docs, 12 tokens" in err and "B/s" in err and "100%" in err


# --- mixtures -------------------------------------------------------------------------------

def _mixture(batch=4, rank=0, world=1, weights=(3.0, 1.0), seed=7):
    # Source k holds ids in [100k, 100k + 100): a window's source is visible in its values.
    dss = [SequenceDataset(TokenSource(np.arange(100 * k, 100 * k + n, dtype=np.int64), 300, f"s{k}"), 4)
           for k, n in enumerate((81, 41))]
    return MixtureBatchIterator(dss, list(weights), batch, seed=seed, rank=rank, world_size=world)


def test_mixture_resumes_mid_epoch_exactly():
    ref = [next(it) for it in [_mixture()] for _ in range(30)]
    first = _mixture()
    for _ in range(11):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives the checkpoint's serialisation
    resumed = _mixture()
    resumed.load_state_dict(state)
    for want in ref[11:]:
        assert np.array_equal(next(resumed).numpy(), want.numpy())
    with pytest.raises(DataError, match="mixture has weights"):
        _mixture(weights=(1.0, 1.0)).load_state_dict(state)


def test_mixture_ranks_split_the_global_batch_and_follow_the_weights():
    whole = _mixture(batch=8)
    ranks = [_mixture(batch=4, rank=r, world=2) for r in range(2)]
    sources = []
    for _ in range(200):
        w = next(whole).numpy()
        assert np.array_equal(np.concatenate([next(r).numpy() for r in ranks]), w)
        sources += (w[:, 0] // 100).tolist()
    # 1600 draws with p = 0.75: the standard deviation of the share is 0.011; allow 4 of them.
    assert abs(np.mean(np.asarray(sources) == 0) - 0.75) < 0.045


def test_mixture_visits_each_window_once_per_epoch():
    it = _mixture(batch=5, weights=(1.0, 1.0))
    starts = {0: [], 1: []}
    for _ in range(40):
        for row in next(it).numpy():
            starts[int(row[0] // 100)].append(int(row[0] % 100))
    for k, n_windows in ((0, 20), (1, 10)):
        seen = starts[k]
        for e in range(len(seen) // n_windows):  # every complete epoch is a permutation
            assert sorted(seen[e * n_windows:(e + 1) * n_windows]) == list(range(0, 4 * n_windows, 4))


def test_mixture_config_is_checked():
    with pytest.raises(Exception, match="set data.source .*or data.sources, not both"):
        load_config(None, ["data.source=mqar", "data.sources=[{path: a, weight: 1}]"])
    with pytest.raises(Exception, match="weight"):
        load_config(None, ["data.sources=[{path: a, weight: 0}]"])


@pytest.mark.slow
def test_mixture_run_resumes_exactly_from_its_checkpoint(tmp_path):
    from k3train.trainer.loop import train
    from tests.helpers import SMALL

    from k3train.data import embedded_documents

    docs = embedded_documents()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:40]))
    prepare_data([tmp_path / "a.jsonl"], tmp_path / "a", TOK)
    sources = f"data.sources=[{{path: {tmp_path / 'a'}, weight: 2}}, {{path: embedded, weight: 1}}]"
    extra = [*SMALL, sources, "train.steps=6", "train.log_interval=1"]
    full, split = tmp_path / "full", tmp_path / "split"
    train(load_config("configs/k3_tiny.yaml", extra), full)
    train(load_config("configs/k3_tiny.yaml", extra), split, stop_at=3)
    train(load_config("configs/k3_tiny.yaml", extra), split, resume=True)
    losses = [[json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, split)]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


# --- stdlib ---------------------------------------------------------------------------------

@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    files = {"z.py": "z = 1\n", "a.py": "a = 'é'\n", "pkg/__init__.py": "", "pkg/mod.py": "def f(): pass\n",
             "test/test_x.py": "skip", "pkg/tests/t.py": "skip", "site-packages/s.py": "skip",
             "pkg/__pycache__/c.py": "skip", "notes.txt": "skip"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: skipped
    for i in range(40):
        (root / f"m{i:02d}.py").write_text(f"value_{i} = {i}\n")
    monkeypatch.setattr(stdlib_corpus, "stdlib_root", lambda: root)
    return root


def test_stdlib_files_rules_and_split(fake_stdlib):
    rels = [rel for rel, _ in stdlib_corpus.stdlib_files()]
    assert rels == sorted(rels) and "a.py" in rels and "pkg/mod.py" in rels
    assert not any(s in r for r in rels for s in ("test", "site-packages", "__pycache__", ".txt"))
    vf = 0.2
    val = {rel for rel, _ in stdlib_corpus.stdlib_documents("val", vf)}
    train = {rel for rel, _ in stdlib_corpus.stdlib_documents("train", vf)}
    expect_val = {r for r in rels if int(hashlib.sha256(r.encode()).hexdigest()[:8], 16) / 16**8 < vf}
    assert val == expect_val - {"pkg/__init__.py", "latin1.py"} and val and train
    assert val.isdisjoint(train) and (val | train) == set(rels) - {"pkg/__init__.py", "latin1.py"}


def test_stdlib_source_is_tokenized_once_into_the_cache(fake_stdlib, tmp_path):
    overrides = ["data.source=stdlib", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.2",
                 "train.seq_len=4", "train.micro_batch_size=1", "train.eval_batches=1"]
    build_data(load_config(None, overrides))
    metas = sorted((tmp_path / "cache").rglob("*.meta.json"))
    assert [m.name for m in metas] == ["train.meta.json", "val.meta.json"]
    stamps = [m.stat().st_mtime_ns for m in metas]
    data = build_data(load_config(None, overrides))
    assert [m.stat().st_mtime_ns for m in metas] == stamps  # reused, not rewritten
    ref = []
    for _, text in stdlib_corpus.stdlib_documents("train", 0.2):
        ref += list(text.encode()) + [256]
    assert json.loads(metas[0].read_text())["num_tokens"] == len(ref)
    assert "stdlib:train" in data.description


def _mixture_ranks_worker(rank, world_size, prefix):
    """Each gloo rank builds the run's data for its DP rank; rank 0 compares the gathered
    batches with one process's batches of the whole global batch."""
    import torch
    import torch.distributed as dist

    sources = f"data.sources=[{{path: {prefix}, weight: 1}}, {{path: embedded, weight: 2}}]"
    common = [sources, "train.seq_len=16", "train.eval_batches=1"]
    data = build_data(load_config(None, [*common, "train.micro_batch_size=2"]), dp_rank=rank, dp_size=world_size)
    mine = torch.stack([next(data.train) for _ in range(12)])  # [steps, 2, 17]
    got = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(got, mine)
    if rank == 0:
        whole = build_data(load_config(None, [*common, f"train.micro_batch_size={2 * world_size}"]))
        want = torch.stack([next(whole.train) for _ in range(12)])
        assert torch.equal(torch.cat(got, dim=1), want)
        assert not torch.equal(got[0], got[1])  # the ranks read different windows


@pytest.mark.slow  # two spawned processes import torch and megatron-core
def test_mixture_is_sharded_over_gloo_data_parallel_ranks(tmp_path):
    from tests.multiproc import run_multiprocess

    (tmp_path / "a.txt").write_text("mixture source " * 400)
    prepare_data([tmp_path / "a.txt"], tmp_path / "a", TOK)
    run_multiprocess(_mixture_ranks_worker, 2, str(tmp_path / "a"))
