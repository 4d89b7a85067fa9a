"""What the written docs say about the code stays true of it.

- The metrics page names every metric the recipe logs and every counter the loader reports: the keys are read off
  the code (the recipe's step record, the step-metrics tables, the pipeline counters, ``loader.stats()``), found
  by name wherever their module lives.
- Every repository path the docs and READMEs name exists, and every relative link of the READMEs resolves (links
  inside ``docs/`` are checked by ``mkdocs build --strict``).
- The user docs carry no dates, commit hashes or issue numbers: those belong in ``CHANGELOG.md`` and the result
  files.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).parents[3]
DOCS = ROOT / "docs"
USER_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.rglob("*.md"))]
SOURCES = [p for d in ("asyncrl", "datapipes", "workers", "recipes") for p in sorted((ROOT / d).rglob("*.py"))]


def _function(name: str, cls: str | None = None) -> tuple[ast.FunctionDef, Path]:
    """The one definition of ``name`` (a method of class ``cls`` if given) in the project's sources."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        scopes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls] if cls else [tree]
        for scope in scopes:
            nodes = scope.body if cls else ast.walk(scope)  # a method of that class, or a def anywhere
            found += [(n, path) for n in nodes if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"expected one definition of {cls + '.' if cls else ''}{name}, found {len(found)}"
    return found[0]


def _constant(name: str):
    """The value of a module-level constant, imported from the module that defines it."""
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                return getattr(importlib.import_module(module), name)
    raise AssertionError(f"no module defines {name}")


def _dict_keys(node: ast.AST) -> set[str]:
    """String keys of every dict literal under ``node``."""
    return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict) for k in d.keys
            if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _returned_dict_keys(fn: ast.FunctionDef) -> set[str]:
    return {k for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None for k in _dict_keys(r.value)}


def _record_keys(path: Path) -> set[str]:
    """Keys assigned as ``record["key"] = ...`` in a file."""
    return {t.slice.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
            and t.value.id == "record" and isinstance(t.slice, ast.Constant)}


def logged_names() -> dict[str, set[str]]:
    """Every metric and counter name the code writes, by where it comes from."""
    train_step, recipe = _function("train_step")
    batch_stats, _ = _function("batch_stats")
    pipeline, _ = _function("pipeline_counters")
    stats, _ = _function("stats", cls="RolloutLoader")
    return {
        "the recipe's step record": _returned_dict_keys(train_step) | _record_keys(recipe)
        | _returned_dict_keys(batch_stats),
        "STEP_METRIC_WEIGHTS": set(_constant("STEP_METRIC_WEIGHTS")),
        "WORKER_KEYS": set(_constant("WORKER_KEYS")),
        "WEIGHT_SYNC_KEYS": set(_constant("WEIGHT_SYNC_KEYS")),
        "pipeline_counters": _returned_dict_keys(pipeline),
        "RolloutLoader.stats": _returned_dict_keys(stats),
    }


def _code_spans(page: Path) -> set[str]:
    """The inline code spans of a Markdown page (fenced blocks left out)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return set(re.findall(r"`([^`\n]+)`", text))


def test_the_metrics_page_names_every_logged_metric():
    documented = _code_spans(DOCS / "reference" / "metrics.md")
    names = logged_names()
    assert len(names["the recipe's step record"]) > 15 and len(names["WORKER_KEYS"]) > 10  # the parse found them
    missing = {where: sorted(n - documented) for where, n in names.items() if n - documented}
    assert not missing, f"docs/reference/metrics.md does not document: {missing}"


PATH = re.compile(r"(?<![\w/.-])(?<!\]\()((?:asyncrl|datapipes|workers|recipes|benchmarks|tests|docs)/[\w./-]*)")
"""A repository path in the text (links inside docs/ are relative to their page: mkdocs checks those)."""
PLACEHOLDER = re.compile(r"[{}*<>]|\bDATE\b|step-N|-N\b")


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for doc in USER_DOCS:
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            for path in PATH.findall(line):
                path = path.split("::")[0].rstrip(".,:;)")
                if PLACEHOLDER.search(path) or path.endswith("-"):
                    continue
                if not (ROOT / path).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{line_no}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_readmes_relative_links_resolve():
    missing = []
    for readme in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text()):
            if "://" not in target and not (readme.parent / target).exists():
                missing.append(f"{readme.relative_to(ROOT)}: {target}")
    assert not missing, "broken links:\n" + "\n".join(missing)


HISTORY = [(re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a date"), (re.compile(r"`(?=[0-9]*[a-f])[0-9a-f]{7,40}`"), "a commit hash"),
           (re.compile(r"\b[Ii]ssue \d+|#\d{2,}\b"), "an issue number")]
FILE_NAME = re.compile(r"[\w./-]*(?:\.json|results/[\w.-]+/?)")


def test_the_user_docs_carry_no_dates_commits_or_issue_numbers():
    found = []
    for doc in USER_DOCS:
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            text = FILE_NAME.sub("", line)  # result files are named by date; their names are references, not prose
            found += [f"{doc.relative_to(ROOT)}:{line_no}: {what}: {m.group(0)}"
                      for pattern, what in HISTORY for m in pattern.finditer(text)]
    assert not found, "history belongs in CHANGELOG.md:\n" + "\n".join(found)


HAND_WRITTEN = [ROOT / "README.md", *[p for p in sorted(DOCS.rglob("*.md")) if p.name not in ("config.md", "cli.md", "api.md")
                                      or p.parent.name != "reference"]]
DOTTED = re.compile(r"`((?:asyncrl|workers|datapipes)(?:\.[A-Za-z_]\w*)+)")


def _resolves(dotted: str) -> bool:
    """A module, or an attribute of one (``asyncrl.data.render_prompt``)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_module_and_name_the_docs_spell_out_exists():
    """Dotted names in backticks (``asyncrl.x.y``) in the hand-written pages import: a module moved or renamed in
    the code fails here until the prose follows (the generated pages follow by themselves)."""
    missing = [f"{doc.relative_to(ROOT)}: {name}" for doc in HAND_WRITTEN for name in DOTTED.findall(doc.read_text())
               if not _resolves(name)]
    assert not missing, "names in the docs that do not import:\n" + "\n".join(missing)


LISTS = [("BUILTIN", "guides/rewards.md"), ("DETECTORS", "guides/debugging.md"), ("STAGES", "guides/models.md"),
         ("LOSS_TYPES", "guides/losses.md")]
"""A constant of the code whose every entry a guide lists: the built-in rewards, the debugger's detectors, the
stages of ``asyncrl check``, the loss types."""


def test_the_guides_list_every_builtin_detector_stage_and_loss_type():
    missing = []
    for constant, page in LISTS:
        documented = _code_spans(DOCS / page)
        missing += [f"docs/{page}: {constant} has {name!r}" for name in _constant(constant) if name not in documented]
    assert not missing, "\n".join(missing)
