"""The base of every config section: unknown keys, inf/NaN and booleans for numbers refused."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _takes_bool(annotation) -> bool:
    """Whether a field's type admits a bool (``bool``, ``Union[bool, ...]``, ``bool | None``)."""
    return annotation is bool or bool in getattr(annotation, "__args__", ())


class StrictModel(BaseModel):
    # allow_inf_nan=False: every float field refuses inf and NaN (optim.lr=.inf once trained to
    # an all-NaN checkpoint and exited 0).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, value, info: ValidationInfo):
        """pydantic's lax mode reads ``true`` as 1 for an int field (hidden_size=true gave a
        one-wide model); only fields typed bool take a bool."""
        if isinstance(value, bool) and not _takes_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number, not a boolean")
        return value
