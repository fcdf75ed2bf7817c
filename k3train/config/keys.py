"""Every config key with its type, default and doc line, read from the schema itself: the doc
line is the attribute docstring written under a field in the schema modules (``schema.py``,
``model_schema.py``, ``data_schema.py``; or its section's class docstring for a section), so ``k3train config --keys`` can never disagree with the code."""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from functools import lru_cache

from pydantic import BaseModel

from k3train.config import data_schema, model_schema, schema
from k3train.config.schema import RunConfig


@dataclass(frozen=True)
class ConfigKey:
    key: str        # dotted, e.g. "train.steps"
    type: str       # the annotation as written, e.g. "int", "Literal['none', 'selective', 'full']"
    default: object
    doc: str        # first line of the field's docstring ('' where the schema has none)


@lru_cache(maxsize=None)
def _field_docs() -> dict[tuple[str, str], str]:
    """{(class name, field name): first docstring line} from the schema modules' source."""
    docs = {}
    classes = (n for module in (schema, model_schema, data_schema)
               for n in ast.parse(inspect.getsource(module)).body if isinstance(n, ast.ClassDef))
    for cls in classes:
        body = cls.body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[(cls.name, stmt.target.id)] = " ".join(nxt.value.value.split())
    return docs


def _type_text(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def config_keys(section: str | None = None) -> list[ConfigKey]:
    """Every leaf key of the run config (under ``section``, e.g. ``train`` or ``model.kda``)."""
    out: list[ConfigKey] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, key + ".")
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = default.model_dump(mode="json")
            out.append(ConfigKey(key, _type_text(ann), default, _field_docs().get((model.__name__, name), "")))

    walk(RunConfig, "")
    if section:
        out = [k for k in out if k.key == section or k.key.startswith(section + ".")]
    return out


def section_names() -> list[str]:
    return sorted({k.key.rsplit(".", 1)[0] for k in config_keys() if "." in k.key})
