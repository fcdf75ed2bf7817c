"""The ``data`` section of the run configuration (sources, mixtures, MQAR, document masking)."""
from __future__ import annotations

from pydantic import Field, model_validator

from k3train.config.strict import StrictModel


class MQARConfig(StrictModel):
    """Multi-query associative recall (``data.source: mqar``), see ``k3train/data/mqar.py``.

    A sequence is ``num_pairs`` key-value pairs, then a query region where ``num_queries`` keys
    reappear, each followed by its value; only those values are targets. Token ranges are
    half-open ``[lo, hi)`` ids of the model vocabulary (checked against ``model.vocab_size``
    when the data is built).
    """

    num_pairs: int = Field(8, ge=1)
    """Key-value pairs at the start of each sequence."""
    num_queries: int | None = Field(None, ge=1)
    """Keys queried per sequence (each at most once); None queries all ``num_pairs``."""
    key_range: tuple[int, int] = (1, 129)
    """Token ids [lo, hi) keys are drawn from."""
    value_range: tuple[int, int] = (129, 257)
    """Token ids [lo, hi) values are drawn from."""
    filler_id: int = Field(0, ge=0)
    """Token filling the query region between queries."""
    val_seed: int = 0
    """Seed of the validation stream (the train stream uses ``train.seed``; the two streams
    also differ by a salt, so equal seeds still give different sequences)."""

    @model_validator(mode="after")
    def _ranges(self) -> "MQARConfig":
        (klo, khi), (vlo, vhi) = self.key_range, self.value_range
        if not (0 <= klo < khi and 0 <= vlo < vhi):
            raise ValueError(f"data.mqar ranges must be non-empty [lo, hi) with lo >= 0, "
                             f"got key_range {self.key_range}, value_range {self.value_range}")
        if klo < vhi and vlo < khi:
            raise ValueError(f"data.mqar.key_range {self.key_range} and value_range "
                             f"{self.value_range} overlap; recall targets must be unambiguous")
        if klo <= self.filler_id < khi or vlo <= self.filler_id < vhi:
            raise ValueError(f"data.mqar.filler_id ({self.filler_id}) lies in the key or value range")
        if khi - klo < self.num_pairs:
            raise ValueError(f"data.mqar.key_range holds {khi - klo} keys, fewer than "
                             f"num_pairs ({self.num_pairs}); keys in a sequence are distinct")
        if self.num_queries is not None and self.num_queries > self.num_pairs:
            raise ValueError(f"data.mqar.num_queries ({self.num_queries}) exceeds num_pairs ({self.num_pairs})")
        return self

    @property
    def queries(self) -> int:
        return self.num_pairs if self.num_queries is None else self.num_queries


class DataSourceConfig(StrictModel):
    """One dataset of a ``data.sources`` mixture."""

    path: str = Field(min_length=1)
    """Like ``data.source``: a dataset prefix, "embedded" or "stdlib" (not "mqar")."""
    weight: float = Field(1.0, gt=0)
    """Relative share of the training windows drawn from this source (normalised over all)."""


class DataConfig(StrictModel):
    source: str = "embedded"
    """"embedded" (Python's documentation text, no download), "stdlib" (the Python standard
    library's .py files, docs/data.md), "mqar" (synthetic associative recall, ``data.mqar``) or
    the prefix of a dataset written by ``k3train prepare-data`` (or a Megatron .bin/.idx made
    elsewhere, with data.tokenizer naming its tokenizer)."""
    tokenizer: str | None = None
    """"byte", a tokenizer.json (or its directory), a tiktoken BPE file or a sentencepiece .model
    (k3train/data/tokenizer.py). None: the tokenizer the dataset's meta file records, "byte" for
    embedded and stdlib."""
    val_fraction: float = Field(0.05, gt=0, lt=1)
    """Share of the documents held out for validation."""
    mqar: MQARConfig = MQARConfig()
    sources: list[DataSourceConfig] = []
    """A weighted mixture, e.g. ``[{path: data/a, weight: 3}, {path: stdlib, weight: 1}]``, used
    instead of ``source`` (which must then keep its default, "embedded"; k3train/data/mixture.py);
    every source needs the same tokenizer."""
    cache_dir: str = ""
    """Where data.source=stdlib keeps its tokenized copy; "" is $XDG_CACHE_HOME/k3train or
    ~/.cache/k3train."""
    document_mask: bool = True
    """Keep the documents packed into one window apart: KDA's state and the short convolutions
    restart, and MLA attends only within the document, at every end-of-document token (which
    opens the next document); no target is masked (docs/data.md). A resumed run keeps the value
    its config.yaml recorded (false for runs from before this key). Needs datasets whose stream
    marks documents (prepare-data, embedded and stdlib do); MQAR windows are whole sequences."""

    @property
    def masks_documents(self) -> bool:
        """Whether batches carry document boundaries: ``document_mask`` on text data (MQAR
        windows are one sequence each, nothing to mask)."""
        return self.document_mask and not (self.source == "mqar" and not self.sources)

    @model_validator(mode="after")
    def _one_source(self):
        if self.sources and self.source != "embedded":
            raise ValueError(f"set data.source ({self.source!r}) or data.sources, not both")
        if any(s.path == "mqar" for s in self.sources):
            raise ValueError("data.sources cannot hold 'mqar' (synthetic data has no windows to mix)")
        return self
