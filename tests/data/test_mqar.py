"""MQAR data: targets exactly at the queries (checked by parsing the window independently),
determinism by seed, exact resume, and recall accuracy of a hand-made perfect model."""
import pytest
import torch

from k3train.config import load_config
from k3train.config.schema import MQARConfig
from k3train.data.mqar import MQARBatchIterator, mqar_batch, mqar_targets, mqar_val_batches, recall_accuracy
from k3train.trainer.data import build_data

CFG = MQARConfig(num_pairs=6, num_queries=4, key_range=(10, 40), value_range=(50, 60), filler_id=3)
SEQ_LEN = 31


def _expected_targets(window: list[int], cfg: MQARConfig) -> list[int]:
    """Independent reference: read the pairs, then walk the query region token by token."""
    P = cfg.num_pairs
    table = {window[2 * i]: window[2 * i + 1] for i in range(P)}
    out = [-100] * (len(window) - 1)
    for t in range(2 * P, len(window) - 1):
        if window[t] in table:
            out[t] = table[window[t]]
    return out


@pytest.mark.parametrize("seed", [0, 7])
def test_targets_are_the_paired_values_at_query_positions(seed):
    windows = mqar_batch(CFG, SEQ_LEN + 1, seed, 0, range(16))
    targets = mqar_targets(windows, CFG)
    assert windows.shape == (16, SEQ_LEN + 1) and targets.shape == (16, SEQ_LEN)
    for w, t in zip(windows.tolist(), targets.tolist()):
        keys, values = w[0:12:2], w[1:12:2]
        assert len(set(keys)) == 6 and all(10 <= k < 40 for k in keys) and all(50 <= v < 60 for v in values)
        assert t == _expected_targets(w, CFG)
        assert sum(x != -100 for x in t) == CFG.num_queries  # each query once, no stray key
        assert all(x == 3 or 10 <= x < 40 or 50 <= x < 60 for x in w[12:])


def test_deterministic_by_seed_and_splits_differ():
    a = mqar_batch(CFG, SEQ_LEN + 1, 5, 0, range(8))
    assert torch.equal(a, mqar_batch(CFG, SEQ_LEN + 1, 5, 0, range(8)))
    assert not torch.equal(a, mqar_batch(CFG, SEQ_LEN + 1, 6, 0, range(8)))
    cfg = load_config(None, ["data.source=mqar", "train.seq_len=31", "train.seed=0", "data.mqar.val_seed=0"])
    data = build_data(cfg)
    assert not torch.equal(next(data.train), data.val[0])  # same seed, different split salt
    assert all(torch.equal(x, y) for x, y in zip(data.val, build_data(cfg).val))


def test_iterator_resume_is_exact_and_dp_ranks_partition_the_batch():
    it = MQARBatchIterator(CFG, SEQ_LEN, batch_size=4, seed=1)
    [next(it) for _ in range(3)]
    state = it.state_dict()
    rest = [next(it) for _ in range(2)]
    fresh = MQARBatchIterator(CFG, SEQ_LEN, batch_size=4, seed=1)
    fresh.load_state_dict(state)
    assert all(torch.equal(x, next(fresh)) for x in rest)
    ranks = [MQARBatchIterator(CFG, SEQ_LEN, batch_size=2, seed=1, rank=r, world_size=2) for r in (0, 1)]
    whole = MQARBatchIterator(CFG, SEQ_LEN, batch_size=4, seed=1)
    for _ in range(2):
        assert torch.equal(torch.cat([next(r) for r in ranks]), next(whole))


def test_build_data_wires_mqar_and_checks_fit():
    cfg = load_config(None, ["data.source=mqar", "train.seq_len=32", "train.micro_batch_size=3",
                             "train.eval_batches=2", "data.mqar.num_pairs=5"])
    data = build_data(cfg)
    assert next(data.train).shape == (3, 33) and [v.shape for v in data.val] == [(3, 33)] * 2
    assert torch.equal(data.targets(data.val[0]), mqar_targets(data.val[0], cfg.data.mqar))
    with pytest.raises(ValueError, match="more than train.seq_len"):
        build_data(load_config(None, ["data.source=mqar", "train.seq_len=16", "data.mqar.num_pairs=8"]))
    with pytest.raises(ValueError, match="outside model.vocab_size"):
        build_data(load_config(None, ["data.source=mqar", "model.vocab_size=200"]))


def test_recall_accuracy_of_perfect_and_blind_models():
    batches = mqar_val_batches(CFG, SEQ_LEN, batch_size=4, num_batches=2)
    vocab = 64

    def perfect(inputs):  # looks each query up in the window's own pairs
        logits = torch.zeros(*inputs.shape, vocab)
        for b, row in enumerate(inputs.tolist()):
            table = {row[2 * i]: row[2 * i + 1] for i in range(CFG.num_pairs)}
            for t, tok in enumerate(row):
                logits[b, t, table.get(tok, 0)] = 1.0
        return logits

    assert recall_accuracy(perfect, batches, CFG) == 1.0
    assert recall_accuracy(lambda x: torch.zeros(*x.shape, vocab), batches, CFG) == 0.0
