"""Plain YAML data (a job config file plus ``--set`` overrides) into typed, validated dataclasses.

Each value is checked against its field's type hint, so ``optim.epochs: "3"`` or a typo'd key is
an error naming the field (with a suggestion), never a silent default.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path

import yaml

from data_pipeline.contract import S3Url
from trainer.objectives import DEFAULT_OBJECTIVE, ObjectiveConfig, objective_config_class


class ConfigError(ValueError):
    """A job config value is wrong; the message names the field and how to fix it."""


def build_dataclass(cls, data, where: str):
    """Recursively turn plain YAML data into the dataclass ``cls``."""
    hint = cls
    if hint is ObjectiveConfig:  # the section's class is chosen by its ``name``
        name = data.get("name", DEFAULT_OBJECTIVE) if isinstance(data, dict) else None
        try:
            hint = objective_config_class(name)
        except ValueError as error:
            raise ConfigError(_join(where, str(error))) from error
    if dataclasses.is_dataclass(hint):
        if not isinstance(data, dict):
            raise ConfigError(f"{where or 'config'} must be a mapping of fields, got {data!r}")
        fields = {f.name: f for f in dataclasses.fields(hint)}
        hints = typing.get_type_hints(hint)
        for key in data:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                suggestion = f"; did you mean {_join(where, close[0])}?" if close else f"; known: {sorted(fields)}"
                raise ConfigError(f"unknown field {_join(where, key)}{suggestion}")
        kwargs = {key: build_dataclass(hints[key], value, _join(where, key)) for key, value in data.items()}
        missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"missing required field(s) {', '.join(_join(where, m) for m in missing)}")
        try:
            return hint(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as error:  # a section's own check: its message starts with the field
            raise ConfigError(_join(where, str(error))) from error
    return _coerce(hint, data, where)


def _coerce(hint, value, where: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        if S3Url in options and isinstance(value, str) and value.startswith("s3://"):
            return _coerce(S3Url, value, where)  # what is wrong with the URL, not "expected a URL or a path"
        settable = [option for option in options if option is not type(None)]
        if len(settable) == 1 and typing.get_origin(settable[0]) is tuple:
            return _coerce(settable[0], value, where)  # its own message: "a list of 2 numbers", not the type's name
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, where)
            except ConfigError:
                continue
        kinds = " or ".join(_KINDS.get(option, str(option)) for option in options if option is not type(None))
        unset = ", or null to leave it unset" if type(None) in options else ""
        raise ConfigError(f"{where}={value!r} is invalid: expected {kinds}{unset}")
    if origin is tuple and typing.get_args(hint)[1:] == (Ellipsis,):  # tuple[float, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} is invalid: expected a list")
        return tuple(_coerce(typing.get_args(hint)[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(typing.get_args(hint)):
            raise ConfigError(f"{where}={value!r} is invalid: expected a list of {len(typing.get_args(hint))} numbers")
        return tuple(_coerce(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(typing.get_args(hint), value)))
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, where)
    if hint is S3Url:
        if not (isinstance(value, str) and value.startswith("s3://")):
            raise ConfigError(f"{where}={value!r} is invalid: expected an s3:// URL")
        try:
            return S3Url(value)
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from error
    if hint is Path:
        if isinstance(value, str) and "://" in value:  # a URL of a scheme nothing here reads
            raise ConfigError(f"{where}={value!r} is invalid: expected a local path or an s3://BUCKET/PREFIX URL")
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{where}={value!r} is invalid: expected a path")
        return Path(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} is invalid: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r} is invalid: expected an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # PyYAML reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} is invalid: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} is invalid: expected a string")
        return value
    return value


# What a value of each plain type is written as, for the messages.
_KINDS = {S3Url: "an s3:// URL", Path: "a path", bool: "true or false", int: "an integer", float: "a number",
          str: "a string"}


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["optim.epochs=3", "data.loader.backend=torch"]`` -> nested updates (values parsed as YAML)."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {override!r} is invalid: use --set section.field=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {override!r}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data
