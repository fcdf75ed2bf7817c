"""The project's error types: what the CLI prints as one line (``k3train: error: ...``).

Anything raised as a ``K3TrainError`` is bad input or a refused operation: the message names what
is wrong and what to do, and the CLI prints it without a traceback. Every other exception is a
bug and keeps its traceback.

The kinds that replaced a ``ValueError`` (config, data, layout, usage) are still ``ValueError`` subclasses, so code and tests written against the
old type keep working.
"""
from __future__ import annotations


class K3TrainError(Exception):
    """Base of the errors a user can act on; the message is one line."""


class RunDirError(K3TrainError):
    """The run directory cannot be used as asked (holds another run, locked, not writable)."""


class CheckpointError(K3TrainError):
    """A checkpoint is missing, corrupt, or does not fit the model or the parallel layout."""


class ConfigError(K3TrainError, ValueError):
    """A config file or override is wrong; the message names the field and what is allowed.
    (Still a ValueError, as it was before the project's error types; ``k3train.config`` exports
    it, the CLI catches it without importing the config room.)"""


class DataError(K3TrainError, ValueError):
    """A dataset cannot be read or does not fit the model (e.g. token ids past the vocabulary)."""


class LayoutError(K3TrainError, ValueError):
    """The parallel layout (tp, pp, vpp, ep, dp) cannot be built on this world size."""


class UsageError(K3TrainError, ValueError):
    """A setting cannot run here (device, precision recipe, export format, environment)."""


class TrainingStopped(K3TrainError):
    """The run stopped itself (e.g. too many non-finite steps); the message names the last
    checkpoint that exists, or says that none was saved."""
