"""Training data: tokenizers, built-in corpora, dataset preparation, batching, mixtures.

megatron-core is imported lazily (inside ``prepare_data`` and ``TokenSource.from_prefix``) because
importing it costs seconds and the embedded corpus does not need it.
"""

from k3train.data.corpus import embedded_documents
from k3train.data.dataset import BatchIterator, SequenceDataset, TokenSource, eval_batches
from k3train.data.prepare import prepare_data
from k3train.data.tokenizer import ByteTokenizer, get_tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "get_tokenizer",
    "load_tokenizer",
    "embedded_documents",
    "prepare_data",
    "TokenSource",
    "SequenceDataset",
    "BatchIterator",
    "eval_batches",
]
