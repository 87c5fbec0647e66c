"""Typed dataclass configs built from plain dicts (YAML), with errors that name the field.

A config section is a frozen dataclass. Fields may be int, float, bool, str, `Literal[...]`, `Optional[...]`,
`tuple[T, ...]`, another config dataclass, or a polymorphic section: a base class with subclasses registered under a
`type:` key (see `register`). Each class may define `check(self)` for cross-field rules; it raises `ConfigError`
through `self.fail(...)`-style helpers below. Field metadata may carry `doc` (and `symbol`, the paper symbol).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

_REGISTRY: dict[type, dict[str, type]] = {}


class ConfigError(ValueError):
    """Bad configuration: names the field (dotted path), the value and what is allowed."""

    def __init__(self, path: str, message: str, source: str | None = None):
        self.path, self.message, self.source = path, message, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}" if path else f"{where}{message}")

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.path, self.message, source)

    def __reduce__(self):  # picklable, so one raised in a `sweep --jobs N` worker reaches the parent whole
        return (ConfigError, (self.path, self.message, self.source))


class ConfigWarning(UserWarning):
    """A config that parses but holds something the run will not use (named in the message)."""


def register(base: type, name: str):
    """Class decorator: register a subclass of a polymorphic section under `type: name`."""

    def deco(cls):
        _REGISTRY.setdefault(base, {})[name] = cls
        return cls

    return deco


def registered(base: type) -> dict[str, type]:
    return dict(_REGISTRY.get(base, {}))


def polymorphic_bases() -> list[type]:
    """Every base class with registered subtypes (the sections chosen by `type:`)."""
    return list(_REGISTRY)


def type_name(base: type, obj) -> str:
    """The `type:` name `obj` (an instance of a subclass of polymorphic `base`) was registered under."""
    for name, cls in _REGISTRY.get(base, {}).items():
        if type(obj) is cls:
            return name
    raise ValueError(f"{type(obj).__name__} is not a registered {base.__name__}")


def doc(text: str, symbol: str | None = None, **kw) -> dict:
    """Field metadata: `x: float = field(default=0.2, metadata=doc("lower clip", "ε_low"))`."""
    m = {"doc": text}
    if symbol:
        m["symbol"] = symbol
    m.update(kw)
    return m


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(tp, value, path: str):
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, path)
            except ConfigError as e:
                errors.append(e.message)
        raise ConfigError(path, f"got {value!r}; allowed: {' or '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"got {value!r}; allowed: {', '.join(repr(a) for a in allowed)}")
        return value
    if origin in (tuple, list):
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"got {value!r}; expected a list")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if origin is tuple:
            if len(args) != len(value):
                raise ConfigError(path, f"got {len(value)} items; expected {len(args)}")
            return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        return [_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"got {value!r}; expected a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"got {value!r}; expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"got {value!r}; expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 1e-6 as a string
                except ValueError:
                    pass
            raise ConfigError(path, f"got {value!r}; expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"got {value!r}; expected a string")
        return value
    raise ConfigError(path, f"unsupported field type {tp}")


def from_dict(cls, data, path: str = ""):
    """Build dataclass `cls` from `data`, recursively; unknown keys and bad values raise ConfigError."""
    if data is None:
        data = {}
    if dataclasses.is_dataclass(data):
        return data
    if isinstance(data, str) and cls in _REGISTRY:  # a polymorphic section by its name alone: `codec: none`
        data = {"type": data}
    if not isinstance(data, dict):
        kind = "a type name or a section with a type: key" if cls in _REGISTRY else "a mapping"
        raise ConfigError(path, f"got {data!r}; expected {kind}")
    data = dict(data)
    if cls in _REGISTRY:
        choices = _REGISTRY[cls]
        name = data.pop("type", getattr(cls, "default_type", None))
        if name not in choices:
            raise ConfigError(
                f"{path}.type" if path else "type", f"got {name!r}; allowed: {', '.join(sorted(choices))}"
            )
        cls = choices[name]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        p = f"{path}.{unknown[0]}" if path else unknown[0]
        moved = getattr(cls, "moved", {})  # keys of older configs: say where each lives now
        if unknown[0] in moved:
            new = moved[unknown[0]]
            raise ConfigError(
                p,
                f"a key of older configs; write {path}.{new} instead"
                if new
                else "a removed key (only one value was ever implemented, and it is how the run works now); delete it",
            )
        raise ConfigError(p, f"unknown key; allowed keys here: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, f"{path}.{name}" if path else name)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(path, str(e)) from None
    check = getattr(obj, "check", None)
    if check is not None:
        try:
            check()
        except ConfigError as e:
            if path and not e.path.startswith(path):
                raise ConfigError(f"{path}.{e.path}" if e.path else path, e.message) from None
            raise
    return obj


def to_dict(obj) -> Any:
    """Inverse of from_dict: plain dicts/lists, with `type:` keys for polymorphic sections."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for base, choices in _REGISTRY.items():
            for name, sub in choices.items():
                if type(obj) is sub:
                    out["type"] = name
        for f in dataclasses.fields(obj):
            out[f.name] = to_dict(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def require(cond: bool, path: str, message: str):
    """Raise ConfigError(path, message) unless cond."""
    if not cond:
        raise ConfigError(path, message)
