"""`section.field=value` overrides, and a Config rebuilt from a saved run's config.json."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Literal

from .base import ConfigError
from .tree import Config

# Keys that moved, with what replaced them.
MOVED = {"train.fp8": "FP8 has its own section now; use fp8.format (with fp8.recipe, fp8.bf16_first_layers, "
                      "fp8.bf16_last_layers, fp8.param)."}


def all_keys(cfg: Config) -> list[str]:
    keys = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(value)]
    return keys


def _parse_value(text: str, annotation, key: str):
    """Turn override text into the field's type, or raise a ConfigError naming the key."""
    hint = annotation
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X], or X | Y: the first type that parses
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() in ("none", "null") and len(args) < len(typing.get_args(hint)):
            return None
        if len(args) > 1:
            for option in args:
                try:
                    return _parse_value(text, option, key)
                except ConfigError:
                    pass
            expected = [w for a in args for w in (("true", "false") if a is bool else typing.get_args(a) or (a.__name__,))]
            raise ConfigError(f"{key}={text!r} is not one of {', '.join(expected)}.")
        hint, origin = args[0], typing.get_origin(args[0])
    if origin is list:
        (item_type,) = typing.get_args(hint) or (str,)
        return [_parse_value(item.strip(), item_type, key) for item in text.split(",") if item.strip()]
    if origin is dict:  # name:number,name:number (or name:text)
        value_type = (typing.get_args(hint) or (str, float))[1]
        out = {}
        for item in filter(None, (i.strip() for i in text.split(","))):
            name, _, value = item.partition(":")
            if value_type is str:
                if not name.strip() or not value.strip():
                    raise ConfigError(f"{key}={text!r}: write name:value pairs separated by commas.")
                out[name.strip()] = value.strip()
                continue
            try:
                out[name.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"{key}={text!r}: write name:number pairs separated by commas.") from None
        return out
    if origin is Literal:
        choices = typing.get_args(hint)
        if text not in choices:
            raise ConfigError(f"{key}={text!r} is not one of {', '.join(map(repr, choices))}.")
        return text
    if hint is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={text!r} is not a boolean; use true or false.")
    if hint in (int, float):
        try:
            number = float(text) if hint is float else int(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r} is not {'an integer' if hint is int else 'a number'}.") from None
        return number
    return text


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `section.field=value` strings in order; unknown keys name the closest valid ones."""
    hints = {name: typing.get_type_hints(type(getattr(cfg, name)))
             for name in (f.name for f in dataclasses.fields(cfg)) if name != "recipe"}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value.")
        key, text = item.split("=", 1)
        section, _, name = key.partition(".")
        if key in MOVED:
            raise ConfigError(f"{key} is gone: {MOVED[key]}")
        if section not in hints or name not in hints[section]:
            close = difflib.get_close_matches(key, all_keys(cfg), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(close)}?" if close else " Run with --print-config to see all keys."
            raise ConfigError(f"unknown config key {key!r}.{hint}")
        setattr(getattr(cfg, section), name, _parse_value(text, hints[section][name], key))
    return cfg


def from_dict(data: dict) -> Config:
    """Rebuild a Config from to_dict() output (as saved in a run directory)."""
    cfg = Config(recipe=data.get("recipe", ""))
    for section, values in data.items():
        if section != "recipe":
            for name, value in values.items():
                setattr(getattr(cfg, section), name, value)
    return cfg
