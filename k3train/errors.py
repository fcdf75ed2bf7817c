"""The project's error types: what the CLI prints as one line (``k3train: error: ...``).

Anything raised as a ``K3TrainError`` is bad input or a refused operation: the message names what
is wrong and what to do, and the CLI prints it without a traceback. Every other exception is a
bug and keeps its traceback.
"""
from __future__ import annotations


class K3TrainError(Exception):
    """Base of the errors a user can act on; the message is one line."""


class RunDirError(K3TrainError):
    """The run directory cannot be used as asked (holds another run, locked, not writable)."""


class CheckpointError(K3TrainError):
    """A checkpoint is missing, corrupt, or does not fit the model or the parallel layout."""


class DataError(K3TrainError):
    """A dataset cannot be read or does not fit the model (e.g. token ids past the vocabulary)."""


class LayoutError(K3TrainError):
    """The parallel layout (tp, pp, vpp, ep, dp) cannot be built on this world size."""
