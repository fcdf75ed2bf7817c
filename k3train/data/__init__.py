"""Training data: tokenizers, built-in corpora, dataset preparation, batching, mixtures.

The names below are imported on first use (``__getattr__``): the batching classes need torch and
megatron-core, which cost seconds to import, and ``prepare-data --help``, the tokenizers and
prepare-data's worker processes need neither.
"""
from importlib import import_module

_HOMES = {
    "ByteTokenizer": "tokenizer", "get_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "embedded_documents": "corpus", "prepare_data": "prepare",
    "TokenSource": "dataset", "SequenceDataset": "dataset", "BatchIterator": "dataset", "eval_batches": "dataset",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'k3train.data' has no attribute {name!r}")
    return getattr(import_module(f"k3train.data.{_HOMES[name]}"), name)
