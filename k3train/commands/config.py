"""Read the config without starting a run. --config FILE [overrides]: the resolved config as
YAML, exactly what a run writes to RUN_DIR/config.yaml. An ablation file
(configs/ablations/*.yaml) as FILE: each variant's resolved differences from the sweep's base,
then the base. --keys [SECTION]: every key with its type, default and doc line.
See docs/configs.md."""
from __future__ import annotations

HELP = "print the resolved config as YAML, an ablation file's variants, or every key with its default and doc"


def add_arguments(p) -> None:
    p.add_argument("--config", help="YAML run config or ablation file, e.g. configs/k3_tiny.yaml")
    p.add_argument("--keys", nargs="?", const="", metavar="SECTION",
                   help="list every key (under SECTION, e.g. train or model.kda) with type, default and doc")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def _is_ablation(path: str) -> bool:
    import yaml

    try:
        tree = yaml.safe_load(open(path, encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # load_config reports it in its own words
    return isinstance(tree, dict) and "base" in tree and ("grid" in tree or "variants" in tree)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_config_or_ablation(path: str, overrides: list[str]):
    """(RunConfig, None) for a run config; (the sweep's base config, text listing each
    variant's differences from it) for an ablation file. ``overrides`` apply to every variant."""
    from k3train.config import load_config
    from k3train.sweep.runner import expand_seeds, load_sweep, variant_config

    if not _is_ablation(path):
        return load_config(path, overrides), None
    sweep = load_sweep(path)
    base = load_config(sweep.base, [*sweep.overrides, *overrides])
    ref = _flat(base.model_dump(mode="json"))
    ignore = ("logging.wandb.group", "logging.wandb.name")
    lines = [f"ablation {path}: base {sweep.base}, {len(sweep.variants)} variants"]
    for variant in expand_seeds(sweep):
        got = _flat(variant_config(sweep, variant, overrides).model_dump(mode="json"))
        diff = [f"{k}={got[k]}" for k in got if got[k] != ref.get(k) and k not in ignore]
        lines.append(f"  {variant.name}: {' '.join(diff) or '(the base)'}")
    return base, "\n".join(lines)


def run(args) -> int:
    from k3train.config import dump_config
    from k3train.config.keys import config_keys, section_names
    from k3train.errors import UsageError

    if args.keys is not None:
        if args.config or args.overrides:
            raise UsageError("config --keys lists the schema; give it no --config or overrides")
        keys = config_keys(args.keys or None)
        if not keys:
            raise UsageError(f"config --keys {args.keys}: no such section; sections: {', '.join(section_names())}")
        width = max(len(k.key) for k in keys)
        for k in keys:
            print(f"{k.key:<{width}}  {k.type}  default {k.default!r}\n{'':<{width}}  {k.doc}")
        return 0
    if not args.config:
        raise UsageError("config needs --config FILE (a run config or an ablation file) or --keys [SECTION]")
    cfg, variants = load_config_or_ablation(args.config, args.overrides)
    if variants:
        print(variants)
        print("# the base, resolved:")
    print(dump_config(cfg), end="")
    return 0
