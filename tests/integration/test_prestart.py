"""Prestarted local workers (workers.prestart): the launcher's first start of a slot takes a waiting interpreter and
hands it its argv plus the variables changed since; restarts are cold; a process whose import-time variables
changed is killed, not used; an unused one exits 0 when its stdin closes, even mid-import; a malformed command line
is refused."""

from __future__ import annotations

import io
import os
import sys
import time

import pytest

from asyncrl.config import TransportConfig, WorkerConfig
from workers import prestart
from workers.launcher import LocalWorkerLauncher
from workers.prestart import await_argv, end_prestarted, prestart_workers, take_prestarted, worker_env

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

WORKERS = [sys.executable, "-m", "workers"]


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    end_prestarted()
    assert not prestart._prestarted


def test_a_prestarted_process_runs_the_argv_it_is_handed():
    (pid,) = prestart_workers(1, engine="fake")
    proc = take_prestarted([*WORKERS, "--help"], worker_env())  # `asyncrl worker --help`: prints, exits 0
    assert proc is not None and proc.pid == pid
    assert proc.wait(timeout=60) == 0
    assert take_prestarted([*WORKERS, "--help"], worker_env()) is None  # used up


def test_not_a_worker_command_line_takes_nothing():
    prestart_workers(1, engine="fake")
    assert take_prestarted([sys.executable, "-c", "pass"], worker_env()) is None
    assert len(prestart._prestarted) == 1


def test_changed_import_time_variable_kills_it_instead_of_using_it():
    (pid,) = prestart_workers(1, engine="hf")  # still importing torch: must not be waited for
    proc = prestart._prestarted[0][0]
    t0 = time.monotonic()
    assert take_prestarted([*WORKERS, "--help"], worker_env({"OMP_NUM_THREADS": "2"})) is None
    assert time.monotonic() - t0 < 5
    assert proc.pid == pid and proc.poll() is not None and not prestart._prestarted


@pytest.mark.parametrize("engine", ["fake", "hf"])
def test_an_unused_process_exits_cleanly_when_its_stdin_closes(engine):
    # closed at once, while it still imports torch (7+ s on a loaded machine): it exits 0 on the EOF then, not once
    # its imports are done (ending it used to wait 5 s and kill it mid-import, exit -9: this test was flaky)
    prestart_workers(1, engine=engine)
    proc = prestart._prestarted[0][0]
    end_prestarted()
    assert proc.returncode == 0


def test_a_line_that_arrives_during_the_imports_is_the_argv(monkeypatch):
    # the reader thread takes the line while the imports run; it is returned once they are done
    line = b'{"argv": ["--connect", "tcp://y"], "env": {}, "unset": []}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line)))
    assert await_argv(["--await-argv", "--preload", "fake"], exit_on_early_eof=True) == ["--connect", "tcp://y"]


def test_the_worker_applies_the_environment_changes_sent_with_its_argv(monkeypatch):
    monkeypatch.setenv("T_PRESTART_GONE", "1")
    line = b'{"argv": ["--connect", "tcp://x"], "env": {"T_PRESTART_NEW": "v"}, "unset": ["T_PRESTART_GONE"]}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line)))
    try:
        assert await_argv(["--await-argv", "--preload", "fake"]) == ["--connect", "tcp://x"]
        assert os.environ["T_PRESTART_NEW"] == "v" and "T_PRESTART_GONE" not in os.environ
    finally:
        os.environ.pop("T_PRESTART_NEW", None)


@pytest.mark.parametrize("line", [b"", b"\n"])
def test_eof_means_not_used(monkeypatch, line):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line)))
    assert await_argv(["--await-argv", "--preload", "fake"]) is None


@pytest.mark.parametrize("line", [b'["--connect", "x"]\n', b'{"argv": [1], "env": {}, "unset": []}\n',
                                  b'{"argv": [], "env": {"A": 1}, "unset": []}\n'])
def test_a_malformed_command_line_is_refused(monkeypatch, line):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line)))
    with pytest.raises(ValueError, match="expected"):
        await_argv(["--await-argv", "--preload", "fake"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="engine"):
        prestart_workers(1, engine="nope")
    with pytest.raises(ValueError, match="n=-1"):
        prestart_workers(-1)


class HelpLauncher(LocalWorkerLauncher):
    """Its workers print the worker's help and exit 0 (so no pool is needed)."""

    def _argv(self, i: int) -> list[str]:
        return [*WORKERS, "--help"]


def test_the_launcher_takes_the_prestarted_process_first_and_restarts_cold():
    (pid,) = prestart_workers(1, engine="fake")
    lau = HelpLauncher(["tcp://127.0.0.1:1"], 1, WorkerConfig(), TransportConfig(), backoff_s=0.0)
    lau.start()
    assert lau.pids == [pid]
    assert lau.procs[0].wait(timeout=60) == 0
    prestart_workers(1, engine="fake")  # one waits, but a restart must not take it
    assert lau.poll() == [(0, 0)]  # found dead and, with no backoff, restarted in the same call
    assert lau.restarts == [1] and lau.pids[0] not in (None, pid, prestart._prestarted[0][0].pid)
    lau.shutdown()


def test_the_loader_prestarts_its_local_workers_only():
    from asyncrl.config import FakeEngineConfig, LoaderConfig
    from datapipes.loader import RolloutLoader

    assert RolloutLoader.prestart_workers(LoaderConfig(num_workers=0)) == []  # remote workers: nothing to start
    config = LoaderConfig(num_workers=2, worker=WorkerConfig(engine=FakeEngineConfig()))
    pids = RolloutLoader.prestart_workers(config)
    assert len(pids) == 2 and [p.pid for p, _ in prestart._prestarted] == pids
