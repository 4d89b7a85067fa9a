"""``docs/reference/config.md``: every config class, every field, from the code.

The config classes are found, not listed: the walk starts at the run file's root class and every config class
``asyncrl`` exports, and follows each field's type (``X``, ``X | None``, ``A | B | C``, ``list[X]``) to the
dataclasses it names. A field's text is the string literal right under it in the class body (read with ``ast``,
the convention of every config class here); its type is the annotation as written; its default is the
dataclass default. Moving a class to another module, splitting one into several, or renaming one regenerates
the page with no change here; a field without a docstring is listed with an empty description, and
``tests/unit/docs/test_docs_generated.py`` fails while the committed page differs from what this writes.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

from docs._gen._text import DOCS, cell, markdown, table

PAGE = DOCS / "reference" / "config.md"
ROOTS = ("RecipeConfig",)
"""Names of the root classes (the YAML run file's top level), looked up in the modules of ``SEARCH``."""
SEARCH = ("asyncrl", "asyncrl.config", "asyncrl.recipe_config", "asyncrl.recipe")
"""Where the roots may live: the first module that imports and has the name wins."""


def _root_classes() -> list[type]:
    found: list[type] = []
    for name in ROOTS:
        for module in SEARCH:
            try:
                mod = importlib.import_module(module)
            except ImportError:
                continue
            cls = getattr(mod, name, None)
            if dataclasses.is_dataclass(cls):
                found.append(cls)
                break
        else:
            raise LookupError(f"config root {name} not found in any of {SEARCH}: update docs/_gen/config_reference.py")
    import asyncrl

    for name in sorted(getattr(asyncrl, "__all__", ())):  # the public surface: configs users build in code
        obj = getattr(asyncrl, name, None)
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and name.endswith("Config") and obj not in found:
            found.append(obj)
    return found


def _dataclasses_in(hint: Any) -> list[type]:
    """The dataclasses a type hint names (through unions, Optional, list/dict and Annotated)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    return [c for arg in typing.get_args(hint) for c in _dataclasses_in(arg)]


def _field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """``{field: (annotation as written, docstring)}`` for ``cls`` and its dataclass bases (bases first)."""
    out: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        source = Path(inspect.getsourcefile(klass)).read_text()
        node = next((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == klass.__name__),
                    None)
        if node is None:
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = (nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                       and isinstance(nxt.value.value, str) else "")
                out[stmt.target.id] = (ast.unparse(stmt.annotation), inspect.cleandoc(doc))
    return out


def _default(f: dataclasses.Field, hint: Any = None) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        base = type(value)()
        changed = {k.name: getattr(value, k.name) for k in dataclasses.fields(value)
                   if getattr(value, k.name) != getattr(base, k.name)}
        return ", ".join(f"{k}: {_yaml(v)}" for k, v in changed.items()) or "(its defaults)"
    return _yaml(value)


def _yaml(value: Any) -> str:
    """A value as a run file would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value and value.strip() == value and not value[0] in "[{*&!|>'\"%@`#" else repr(value)
    if isinstance(value, float) and value == int(value) and abs(value) >= 1e6:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _walk(roots: list[type]) -> tuple[list[type], dict[type, list[str]]]:
    """Every config class reachable from ``roots`` (depth first, in field order) and the YAML paths of each: the
    first root's tree is the run file (``""`` is its top level); a class reached only from a later root is one users
    build in code (no path)."""
    order: list[type] = []
    paths: dict[type, list[str]] = {}

    def visit(cls: type, path: str | None, seen: tuple[type, ...]) -> None:
        if cls not in order:
            order.append(cls)
        paths.setdefault(cls, [])
        if path is not None and path not in paths[cls]:
            paths[cls].append(path)
        if cls in seen:
            return
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for sub in _dataclasses_in(hints[f.name]):
                visit(sub, None if path is None else f"{path}{f.name}.", (*seen, cls))
        for variant in _variants(cls):  # a field typed by a base holds any of its subclasses (e.g. one per `type`)
            visit(variant, path, (*seen, cls))

    for i, root in enumerate(roots):
        if i == 0 or root not in order:
            visit(root, "" if i == 0 else None, ())
    return order, paths


def _variants(cls: type) -> list[type]:
    """The dataclass subclasses of ``cls`` (direct ones, in definition order)."""
    return [c for c in cls.__subclasses__() if dataclasses.is_dataclass(c)]


def _base(cls: type, known: set[type]) -> type | None:
    """The nearest dataclass base of ``cls`` that has a section of its own."""
    return next((b for b in cls.__mro__[1:] if b in known), None)


def _chosen_by(cls: type, known: set[type]) -> str:
    """`` (type: hf)`` for a variant its base's ``type`` field chooses; else ``""``."""
    base = _base(cls, known)
    mine = {f.name: f for f in dataclasses.fields(cls)}.get("type")
    theirs = {f.name: f for f in dataclasses.fields(base)}.get("type") if base else None
    if mine is None or theirs is None or _default(mine) == _default(theirs) or _default(mine) == "required":
        return ""
    return f" (`type: {_default(mine)}`)"


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def _section(cls: type, paths: list[str], known: set[type]) -> str:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    where = ", ".join(f"`{p.rstrip('.')}`" if p else "the top level" for p in paths) or "not in a run file"
    where += _chosen_by(cls, known) if paths else ""
    doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""  # not the generated one
    head = [f"## {cls.__name__}", "", markdown(inspect.cleandoc(doc)), "",
            f"`{cls.__module__}.{cls.__name__}`; in a run file: {where}.", ""]
    base = _base(cls, known)
    inherited = {f.name: f for f in dataclasses.fields(base)} if base else {}
    if base:
        head += [f"It has every field of [{base.__name__}](#{_anchor(base)}); below, the fields it adds or whose "
                 "default it changes.", ""]
    rows = []
    for f in dataclasses.fields(cls):
        old = inherited.get(f.name)
        if old is not None and _default(old, None) == _default(f, None):
            continue  # as in the base's section
        annotation, doc = docs.get(f.name, (str(hints[f.name]), ""))
        subs = [s for s in _dataclasses_in(hints[f.name]) if s in known]
        text = markdown(doc)
        if subs:
            text = (text + " " if text else "") + "See " + ", ".join(f"[{s.__name__}](#{_anchor(s)})" for s in subs) + "."
        rows.append([f"`{f.name}`", f"`{annotation}`", f"`{_default(f, hints[f.name])}`", text])
    return "\n".join([*head, table(["key", "type", "default", "description"], rows), ""])


def render() -> dict[Path, str]:
    order, paths = _walk(_root_classes())
    known = set(order)
    intro = textwrap.dedent("""\
        # Configuration reference

        Generated from the config dataclasses' field docstrings by `python -m docs._gen`: edit the docstring in
        the code, not this page (`tests/unit/docs/test_docs_generated.py` fails while they differ).

        A run file of the recipe (`recipes/configs/*.yaml`) is one `RecipeConfig`: each section below is a nested
        key, and any key can be overridden on the command line as `section.key=value` (the value is read as
        YAML). Unknown keys are refused with the known ones listed. The same classes configure the library in
        code, e.g. `LoaderConfig(max_staleness=1, worker=WorkerConfig(...))`.

        """)
    index = ["| class | where in a run file |", "|---|---|"]
    for cls in order:
        where = ", ".join(f"`{p.rstrip('.')}`" if p else "top level" for p in paths[cls]) or "code only"
        where += _chosen_by(cls, known) if paths[cls] else ""
        index.append(f"| [{cls.__name__}](#{_anchor(cls)}) | {cell(where)} |")
    body = [intro, "\n".join(index), ""] + [_section(c, [p for p in paths[c]], known) for c in order]
    return {PAGE: "\n".join(body).rstrip() + "\n"}


if __name__ == "__main__":
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
