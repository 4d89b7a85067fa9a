"""Config dataclasses from nested dicts (run files, JSON sent to workers) and dotted ``KEY=VALUE`` overrides.

One grammar for every override, wherever it is given (``recipes/grpo.py ... train.steps=50``, ``asyncrl worker
--set worker.slots=8``): a dotted key, ``=``, a YAML value (``0``, ``1e-4``, ``true``, ``null``, ``[a, b]``,
``{k: v}``, a bare string). Unknown keys are refused, naming the closest known key ("did you mean"); a key that was
renamed or moved is refused with its new name (:mod:`asyncrl.config.renames`); an engine field of another engine type
is refused with the type it belongs to.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from asyncrl.config.engine import FIELD_NOTES, engine_field_owners
from asyncrl.config.renames import renamed

__all__ = ["apply_overrides", "check_keys", "closest", "from_dict", "load_run_file", "to_dict"]

C = TypeVar("C")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as nested plain data (what :func:`from_dict` reads back; JSON- and YAML-able)."""
    return dataclasses.asdict(cfg)


_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _scalar(key: str, hint: Any, value: Any) -> Any:
    """``value`` for a field typed ``hint`` (``float``, ``int``, ``bool``, or one of them ``| None``): YAML 1.1 reads
    ``1e-4`` (no dot) as a string and ``3`` as an int, so a float field takes both as floats; anything else of the
    wrong scalar type is refused with the key's name. Other hints pass the value through unchanged."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    if value is None and type(None) in args:
        return None
    scalars = [t for t in (hint, *args) if t in (float, int, bool)]
    if len(scalars) != 1 or (args and set(args) - {scalars[0], type(None)}):
        return value  # str, Literal, lists, unions of several kinds: the dataclass checks them
    kind = scalars[0]
    if kind is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    raise ValueError(f"{key} must be {kind.__name__}, got {value!r} ({type(value).__name__})")


def _variant(cls: type, data: dict[str, Any], path: str) -> type:
    """The class a dict builds when ``cls`` is a base with variants by ``type`` (the engine configs); else ``cls``."""
    variants = getattr(cls, "VARIANTS", None)
    if not variants or cls in variants.values():
        return cls
    kind = data.get("type", cls.__dataclass_fields__["type"].default)
    if kind not in variants:
        raise ValueError(f"{path}type={kind!r} is not one of {sorted(variants)}")
    return variants[kind]


def _refuse_unknown(cls: type, unknown: list[str], path: str) -> None:
    for key in unknown:
        if (new := renamed(cls.__name__, key)) is not None:
            raise ValueError(f"{path}{key} was renamed (or moved): use {new}")
    kind = getattr(cls, "VARIANTS", None) and cls.__dataclass_fields__["type"].default
    for key in unknown if kind else ():
        if owners := engine_field_owners(key):
            note = FIELD_NOTES.get((kind, key))
            raise ValueError(f"{path}{key} is a {'/'.join(owners)} engine field; "
                             f"this engine is type {kind}" + (f" ({note})" if note else ""))
    known = sorted(f.name for f in dataclasses.fields(cls))
    guesses = [f"{path}{key}: did you mean {path}{match}?" if (match := closest(key, known)) else f"{path}{key}"
               for key in unknown]
    raise ValueError(f"unknown {cls.__name__} key{'s' if len(unknown) > 1 else ''} {'; '.join(guesses)} "
                     f"(known: {', '.join(known)})")


def closest(key: str, known: Iterable[str]) -> str | None:
    """The known key closest to a misspelt ``key`` (``difflib``), or None when none is close."""
    known = list(known)
    by_case = {k.lower(): k for k in known}
    if key.lower() in by_case:
        return by_case[key.lower()]
    matches = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return matches[0] if matches else None


def check_keys(cls: type, keys: Iterable[str], path: str = "") -> None:
    """Refuses keys that are not fields of the config class ``cls`` (``path``: their dotted prefix in the run file).

    Raises:
        ValueError: naming each unknown key with the closest known one ("did you mean"), or its new name if it was
            renamed, or the engine type it belongs to.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(keys) - fields):
        _refuse_unknown(cls, unknown, path)


def from_dict(cls: type[C], data: dict[str, Any], _path: str = "") -> C:
    """Builds a config dataclass from a nested dict, rejecting unknown keys and scalars of the wrong type.

    Nested dataclass fields (``X`` or ``X | None``) are built from nested dicts, recursively; an engine config from a
    dict with ``type`` (``hf``, ``vllm``, ``fake``; none: ``fake``). A ``float`` field accepts ints and numeric
    strings (YAML reads ``lr: 1e-4`` as a string); an ``int`` or ``bool`` field given anything else raises.

    Raises:
        ValueError: naming the dotted key: an unknown key (a renamed one with its new name, another engine type's
            field with its type), a scalar of the wrong type, or the config's own checks.
    """
    cls = _variant(cls, data, _path)
    hints = typing.get_type_hints(cls)
    check_keys(cls, data, _path)
    kwargs = {}
    for name, value in data.items():
        sub = next((t for t in (hints[name], *typing.get_args(hints[name])) if dataclasses.is_dataclass(t)), None)
        if sub is not None and isinstance(value, dict):
            kwargs[name] = from_dict(sub, value, f"{_path}{name}.")
        else:
            kwargs[name] = _scalar(f"{_path}{name}", hints[name], value)
    return cls(**kwargs)


def apply_overrides(tree: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Sets each dotted ``KEY=VALUE`` of ``overrides`` in the nested dict ``tree`` (in place; returned too); values
    are parsed as YAML.

    Raises:
        SystemExit: an override without ``=``, with the form to use.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} must be KEY=VALUE (a dotted key, a YAML value), e.g. "
                             "rollout.max_staleness=0")
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return tree


def load_run_file(cls: type[C], path: str | None, overrides: Iterable[str]) -> C:
    """A YAML run file (or nothing) plus dotted ``KEY=VALUE`` overrides (:func:`apply_overrides`), as ``cls``."""
    tree: dict[str, Any] = yaml.safe_load(Path(path).read_text()) if path else {}
    return from_dict(cls, apply_overrides(tree or {}, overrides))
