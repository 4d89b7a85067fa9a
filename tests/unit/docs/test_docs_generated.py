"""The generated docs are current: each page ``python -m docs._gen`` writes equals the committed one.

The configuration reference is read off the config dataclasses' field docstrings, the command-line reference off
the commands' ``--help``, the API reference off ``asyncrl.__all__``, and the benchmark tables (their pages, the index
in ``benchmarks/README.md`` and the numbers in ``README.md``) off the newest result file of each benchmark. Change
one side without the other and this fails with the diff; ``python -m docs._gen`` brings the pages back in step.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from docs._gen import __main__ as gen
from docs._gen import benchmark_pages, config_reference


@pytest.mark.parametrize("name", sorted(gen.GENERATORS))
def test_the_generated_pages_are_current(name):
    diffs = gen.stale([name])
    assert not diffs, (f"generated docs out of date; run `python -m docs._gen {name}` and commit the result:\n"
                       + "\n".join(d[:3000] for d in diffs.values()))


def test_the_config_reference_reads_field_docstrings_of_classes_it_finds(tmp_path, monkeypatch):
    """The walk finds nested and union-typed config classes and takes each field's docstring from the source."""
    module = tmp_path / "docs_gen_probe.py"
    module.write_text(textwrap.dedent('''
        from __future__ import annotations
        from dataclasses import dataclass, field

        @dataclass(kw_only=True, slots=True)
        class HFEngine:
            """An engine."""
            type: str = "hf"
            """Which engine."""

        @dataclass(kw_only=True, slots=True)
        class FakeEngine:
            type: str = "fake"
            steps: int = 3
            """Fake steps."""

        @dataclass(kw_only=True, slots=True)
        class Root:
            """The run."""
            engine: HFEngine | FakeEngine = field(default_factory=FakeEngine)
            """The engine, by type."""
            name: str | None = None
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import docs_gen_probe as probe

    order, paths = config_reference._walk([probe.Root])
    assert [c.__name__ for c in order] == ["Root", "HFEngine", "FakeEngine"]
    assert paths[probe.FakeEngine] == ["engine."]
    section = config_reference._section(probe.FakeEngine, paths[probe.FakeEngine], set(order))
    assert "| `steps` | `int` | `3` | Fake steps. |" in section
    assert "| `type` | `str` | `fake` |  |" in section  # a field without a docstring: an empty description
    root = config_reference._section(probe.Root, [""], set(order))
    assert "The engine, by type. See [HFEngine](#hfengine), [FakeEngine](#fakeengine)." in root


def test_a_benchmark_table_comes_from_the_newest_result_of_its_series(tmp_path):
    """Newest by the date the file records (not its name); another benchmark's or series' files are ignored."""
    def write(name: str, date: str, value: float, bench: str = "debugger_overhead") -> None:
        row = {"tokens": 1024, "collate_ms": 1.0, "observe_ms": value, "observe_with_dump_ms": 2 * value,
               "observe_vs_collate": value, "record_line_bytes": 10}
        (tmp_path / name).write_text(json.dumps({"benchmark": bench, "date": date, "metrics": {"64": row}}))

    write("debugger_overhead-z-old.json", "2026-01-01T00:00:00+00:00", 111.0)
    write("debugger_overhead-a-new.json", "2026-03-01T00:00:00+00:00", 222.0)
    write("other-new.json", "2027-01-01T00:00:00+00:00", 333.0, bench="something_else")
    results = benchmark_pages.load_results(tmp_path)
    bench = next(b for b in benchmark_pages.BENCHMARKS if b.page == "debugger_overhead")
    newest = benchmark_pages.newest(results, bench.series[0])
    assert newest.path.name == "debugger_overhead-a-new.json"
    block, headline, first = benchmark_pages._block(bench, results)
    assert "222.0" in block and "111.0" not in block and "333.0" not in block
    assert headline == "222 ms a step for 64 rollouts" and first.endswith("debugger_overhead-a-new.json")
