"""Load YAML configs, apply ``key.sub=value`` overrides, and report errors by field name."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from k3train.config.schema import RunConfig
from k3train.errors import ConfigError


def _allowed_keys(model_cls: type[BaseModel], path: tuple) -> list[str]:
    """Field names accepted at ``path`` (a tuple of keys) inside ``model_cls``."""
    cls = model_cls
    for key in path:
        field = cls.model_fields.get(key)
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        cls = ann
    return sorted(cls.model_fields)


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        name = ".".join(loc) or "<config>"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(RunConfig, loc[:-1])
            lines.append(f"unknown config key '{name}'; allowed keys here: {', '.join(allowed)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            # Cross-field validators already name their fields in the message.
            lines.append(msg if not loc or msg.startswith(name + ".") else f"{name}: {msg}{shown}")
    if len(lines) == 1:     # one mistake: one line (the CLI prints it as it is)
        return f"invalid config: {lines[0]}"
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=1e-3"`` -> (["optim", "lr"], 0.001). Values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{text}' has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': value is not valid YAML ({exc})") from None
    return keys, value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = tree
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{k}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return tree


def config_from_dict(tree: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Read ``path`` (YAML; None for all defaults), apply overrides, validate."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist (configs/ lists the shipped ones)")
        try:
            tree = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {exc.start}); expected a YAML "
                              f"mapping of sections") from None
        except OSError as exc:
            raise ConfigError(f"config file '{p}' cannot be read ({exc.strerror or exc})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections, got {type(tree).__name__}")
    return config_from_dict(apply_overrides(tree, list(overrides or [])))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
