"""The layering rule, checked on the source (``ast`` only: nothing is imported or executed).

1. Core ``asyncrl`` never imports ``workers`` or ``datapipes``. Only the application layer may: the CLI
   (``asyncrl.cli``), the model check (``asyncrl.check``), the debugger (``asyncrl.debug``) and the integrations
   (``asyncrl.integrations``). The layers, bottom up: ``asyncrl`` core <- ``datapipes`` and ``workers`` <- the
   application layer, ``recipes/``, ``benchmarks/``.
2. No import cycle among the modules of ``asyncrl``, ``datapipes`` and ``workers``: the graph of module-level
   imports (those inside functions and under ``if TYPE_CHECKING:`` do not count) has no strongly connected
   component of more than one module. A package's ``__init__`` importing its modules is not a cycle; a module
   importing its own package's ``__init__`` while that ``__init__`` imports it is.
3. ``import asyncrl`` stays light: its ``__init__`` imports nothing of the project at module level (its public names
   are loaded on first access), so a process importing it imports neither ``workers`` nor ``datapipes``.

The same rule, with the layout, is written in ``docs/concepts/architecture.md`` ("Layout and layering").
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "datapipes", "workers")
APPLICATION = ("asyncrl.cli", "asyncrl.check", "asyncrl.debug", "asyncrl.integrations")
"""The modules of ``asyncrl`` that may import ``workers`` and ``datapipes`` (and the packages under them)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports executed when the module is imported: not in functions, not under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The project modules an import statement imports (``from pkg import mod`` names ``pkg.mod``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return {n for n in names if n.split(".")[0] in PACKAGES}
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] not in PACKAGES:
        return set()
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_targets(name, path, n, modules) for n in _top_level_imports(tree))) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_application(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in APPLICATION)


def test_core_asyncrl_never_imports_workers_or_datapipes():
    """Every import of ``workers``/``datapipes`` by an ``asyncrl`` module, at any depth (a function-local import
    counts too: it runs in the same process), is in the application layer."""
    offenders = []
    for name, path in _modules().items():
        if not name.startswith("asyncrl") or _is_application(name):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, path, node, {}):
                    if target.split(".")[0] in ("workers", "datapipes"):
                        offenders.append(f"{name}:{node.lineno} imports {target}")
    assert not offenders, "core asyncrl imports the layers above it:\n" + "\n".join(offenders)


TRACKER_LIBRARIES = ("tensorboard", "wandb", "mlflow", "torch.utils.tensorboard")
"""Optional extras (``report_to``): imported by ``asyncrl.integrations.trackers`` alone, inside functions."""


def test_experiment_trackers_stay_optional_and_out_of_core():
    """No core module imports ``asyncrl.integrations`` (where the trackers live), and the trackers' libraries are
    imported only by ``asyncrl.integrations.trackers``, inside the function that needs one: a run without them, or
    a worker process, never imports them."""
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        local = {id(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))} - {
            id(n) for n in _top_level_imports(tree)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if name.startswith("asyncrl") and not _is_application(name) and any(
                    t.startswith("asyncrl.integrations") for t in _targets(name, path, node, {}) | set(names)):
                offenders.append(f"{name}:{node.lineno} (core) imports asyncrl.integrations")
            for lib in names:
                if any(lib == t or lib.startswith(f"{t}.") for t in TRACKER_LIBRARIES):
                    if name != "asyncrl.integrations.trackers" or id(node) not in local:
                        offenders.append(f"{name}:{node.lineno} imports {lib}")
    assert not offenders, "experiment trackers imported where they must not be:\n" + "\n".join(offenders)


def test_no_package_has_an_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_import_asyncrl_is_light():
    tree = ast.parse((ROOT / "asyncrl" / "__init__.py").read_text())
    init = ROOT / "asyncrl" / "__init__.py"
    project = [t for n in _top_level_imports(tree) for t in _targets("asyncrl", init, n, {})]
    assert not project, f"asyncrl/__init__.py imports {project} at module level; load public names on first access"


def test_the_checker_sees_a_cycle_and_ignores_type_checking_and_local_imports():
    """The checker itself: a two-module cycle is found; the same edge in a function or under TYPE_CHECKING is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nimport asyncrl.rollout\nif TYPE_CHECKING:\n"
                     "    import workers.worker\ndef f():\n    import datapipes.loader\n")
    found = {t for n in _top_level_imports(tree) for t in _targets("x", ROOT / "x.py", n, {})}
    assert found == {"asyncrl.rollout"}
