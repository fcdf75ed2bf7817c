"""Run configuration: typed schema, YAML loading and command-line overrides."""
from k3train.config.load import ConfigError, apply_overrides, dump_config, load_config
from k3train.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "apply_overrides", "dump_config", "load_config"]
