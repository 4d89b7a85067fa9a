"""``docs/reference/api.md``: the public names of ``asyncrl`` (its ``__all__``), each with its signature and summary.

What ``from asyncrl import ...`` offers is read off the package itself, so a name added to or dropped from the
public surface regenerates the page with no change here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

from docs._gen._text import DOCS, markdown

PAGE = DOCS / "reference" / "api.md"
PACKAGE = "asyncrl"


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""  # the dataclass's generated signature, not a docstring
    first = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    return markdown(first)


def _signature(name: str, obj: object) -> str:
    if dataclasses.is_dataclass(obj) and name.endswith("Config"):
        return f"{name}(*, ...)  # keyword arguments: the fields"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    text = f"{name}{sig.replace(parameters=params, return_annotation=inspect.Signature.empty)}"
    return re.sub(r"<(?:function|class|bound method) ([\w.]+)[^>]*>", r"\1", text)  # no memory addresses


def render() -> dict[Path, str]:
    package = importlib.import_module(PACKAGE)
    lines = ["# Public API", "",
             f"Generated from `{PACKAGE}.__all__` and the docstrings by `python -m docs._gen`. Everything here is "
             f"importable as `from {PACKAGE} import NAME`; other modules are internal and may move. Config classes "
             "have their fields in the [configuration reference](config.md).", ""]
    kinds: dict[str, list[str]] = {"Classes": [], "Functions": [], "Other": []}
    for name in sorted(package.__all__):
        obj = getattr(package, name)
        kind = "Classes" if inspect.isclass(obj) else "Functions" if callable(obj) else "Other"
        home = getattr(obj, "__module__", None) or PACKAGE
        fields = (f" Fields: [{name}](config.md#{name.lower()})." if dataclasses.is_dataclass(obj)
                  and name.endswith("Config") else "")
        block = [f"### `{name}`", "", "```python", _signature(name, obj), "```", "",
                 f"Defined in `{home}`." + (f" {_summary(obj)}" if _summary(obj) else "") + fields, ""]
        kinds[kind] += block
    for title, body in kinds.items():
        if body:
            lines += [f"## {title}", "", *body]
    return {PAGE: "\n".join(lines).rstrip() + "\n"}


if __name__ == "__main__":
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
