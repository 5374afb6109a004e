"""The `jaxpar train` arguments a rendered job will run, checked before the job is written.

A job that can only fail costs a queue wait and a failed allocation; a missing --config, an
unknown --set field or a value `jaxpar train` refuses is refused here, in the same one line the
job would print. The config file is read on this machine: render from the checkout the job runs.
Nothing here imports JAX.
"""
from __future__ import annotations

from jaxpar.config import ConfigError, apply_overrides, load_config, validate_fields


def check_train_args(train_args: list[str]) -> None:
    """Load the config `train_args` name (--config FILE, --set FIELD=VALUE) and check its fields."""
    config_path, overrides = None, []
    words = iter(train_args)
    for word in words:
        key, equals, value = word.partition("=")
        if key not in ("--config", "--set"):
            continue
        if not equals:
            following = next(words, None)
            if following is None:
                raise ConfigError(key, "needs a value after it (in the arguments for `jaxpar train`)")
            value = following
        if key == "--config":
            config_path = value
        else:
            overrides.append(value)
    config = load_config(config_path)
    apply_overrides(config, overrides)
    validate_fields(config)
