"""The default training corpus: Python's own documentation topics, shipped with the interpreter.

k3train's machines may reach only package registries, so the quickstart cannot download a data
set. ``pydoc_data.topics`` (standard library, used by ``help()``) holds about 465k characters of
real English technical prose, one entry per language topic (``"assignment"``, ``"with"``, ...).
It is small, but large enough for a tiny model's loss to fall well below the unigram baseline,
which is what the CPU quickstart and CI need to show.
"""

from __future__ import annotations

__all__ = ["embedded_documents"]


def embedded_documents() -> list[str]:
    """The pydoc topics, one document per topic, ordered by sorted topic key.

    The dict's own order depends on how the Python build generated the module; sorting the keys
    makes the corpus, and hence the train/val split, identical on every interpreter.
    """
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]
