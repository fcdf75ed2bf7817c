"""The hybrid layer layout as data: a pattern string of K (KDA) and M (gated MLA)."""
from __future__ import annotations

import re

MIXERS = {"K": "kda", "M": "mla"}
_TERM = re.compile(r"^([KM]+)(?:\*(\d+))?$")


def expand_layer_pattern(pattern: str, num_layers: int) -> list[str]:
    """Expand ``pattern`` into one letter per layer.

    ``"KKKM"`` with 8 layers -> KKKMKKKM (a single unit repeats; ``num_layers`` must be a multiple
    of its length). ``"KKKM*21+KKM*3"`` -> the terms concatenated; the total must equal
    ``num_layers``. Raises ValueError naming what is wrong.
    """
    text = pattern.replace(" ", "")
    terms = text.split("+")
    units = []
    for term in terms:
        m = _TERM.match(term)
        if not m:
            raise ValueError(
                f"model.layer_pattern: term '{term}' of '{pattern}' is not letters K/M optionally "
                f"followed by *N (K = KDA, M = gated MLA), e.g. 'KKKM' or 'KKKM*21+KKM*3'"
            )
        repeat = int(m.group(2) or 1)
        if repeat < 1:
            raise ValueError(f"model.layer_pattern: term '{term}' of '{pattern}' repeats its unit "
                             f"{repeat} times; a repeat count must be at least 1")
        units.append(m.group(1) * repeat)
    layers = "".join(units)
    if len(terms) == 1 and "*" not in text:
        if num_layers % len(layers):
            raise ValueError(
                f"model.layer_pattern '{pattern}' (length {len(layers)}) does not tile "
                f"model.num_layers={num_layers}; use a multiple of {len(layers)} layers or an explicit 'A*n+B*m' pattern"
            )
        layers = layers * (num_layers // len(layers))
    if len(layers) != num_layers:
        raise ValueError(
            f"model.layer_pattern '{pattern}' expands to {len(layers)} layers but model.num_layers={num_layers}"
        )
    return list(layers)
