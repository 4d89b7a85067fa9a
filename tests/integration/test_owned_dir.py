"""Owner-locked scratch directories: a SIGKILLed maker's directory is removed by the next maker, a live one never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl._owned_dir import OWNER, UNLOCKED_GRACE_S, make_owned_dir, sweep_dead

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

PREFIX = "asyncrl-test-owned-"

_MAKER = """
import sys, time
from asyncrl._owned_dir import make_owned_dir
d, _ = make_owned_dir(sys.argv[1], sys.argv[2])
(d.path / "blob").write_bytes(b"x" * (1 << 20))
print(d.path, flush=True)
time.sleep(600)
"""

_SHM_BROADCASTER = """
import time, torch
from asyncrl.weights.shm import ShmWeightBroadcaster
b = ShmWeightBroadcaster(bucket_bytes=1 << 16)
b.publish({"w": torch.ones(1 << 18)}, 1)  # two 1 MiB slots' worth of segments in /dev/shm
print(b.address, flush=True)
time.sleep(600)
"""


def _start(code: str, *args: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, f"the maker exited with {proc.wait(timeout=30)} before naming its directory"
    return proc, Path(line)


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


def test_a_live_makers_directory_is_kept_and_a_sigkilled_ones_is_removed_by_the_next_maker(tmp_path):
    proc, path = _start(_MAKER, PREFIX, str(tmp_path))
    try:
        assert path.parent == tmp_path and path.name.startswith(PREFIX) and (path / OWNER).exists()
        swept = sweep_dead(PREFIX, tmp_path)
        assert swept.removed == () and path.exists(), "a live maker's directory must never be swept"
    finally:
        _kill(proc)
    assert path.exists(), "SIGKILL skips every cleanup: this is the leak"
    mine, swept = make_owned_dir(PREFIX, tmp_path)
    try:
        assert not path.exists()
        assert [p for p, _ in swept.removed] == [str(path)] and swept.removed_bytes >= 1 << 20
        assert sweep_dead(PREFIX, tmp_path).removed == () and mine.path.exists(), "the sweeper's own is live"
    finally:
        mine.close()
    assert not mine.path.exists() and list(tmp_path.iterdir()) == []
    mine.close()  # idempotent


def test_two_owned_directories_of_one_process_do_not_sweep_each_other(tmp_path):
    a, _ = make_owned_dir(PREFIX, tmp_path)
    b, swept = make_owned_dir(PREFIX, tmp_path)  # flock is per open file: a's lock holds against b's sweep
    assert swept.removed == () and a.path.exists() and b.path.exists() and a.path != b.path
    a.close(), b.close()


def test_half_made_and_legacy_directories(tmp_path):
    old = time.time() - 2 * UNLOCKED_GRACE_S
    crashed = tmp_path / f".{PREFIX}new-crashed"  # its maker died between mkdtemp and taking the lock
    crashed.mkdir()
    os.utime(crashed, (old, old))
    fresh = tmp_path / f".{PREFIX}new-fresh"  # may be mid-making right now
    fresh.mkdir()
    locking = tmp_path / f".{PREFIX}new-locking"  # its maker created .owner and has not locked it yet
    locking.mkdir()
    (locking / OWNER).touch()
    crashed_locked = tmp_path / f".{PREFIX}new-crashed-after-open"  # died between creating .owner and the rename
    crashed_locked.mkdir()
    (crashed_locked / OWNER).touch()
    os.utime(crashed_locked, (old, old))
    legacy = tmp_path / f"{PREFIX}legacy"  # made before owner locks: its maker may be alive
    legacy.mkdir()
    (legacy / "seg").write_bytes(b"y" * 8192)
    other = tmp_path / "someone-else"
    other.mkdir()
    swept = sweep_dead(PREFIX, tmp_path)
    assert sorted(p for p, _ in swept.removed) == sorted([str(crashed), str(crashed_locked)])
    assert not crashed.exists() and not crashed_locked.exists()
    assert fresh.exists() and locking.exists() and legacy.exists() and other.exists()
    assert [p for p, _ in swept.legacy] == [str(legacy)] and swept.legacy[0][1] >= 8192


def test_a_missing_base_sweeps_nothing(tmp_path):
    assert sweep_dead(PREFIX, tmp_path / "absent").removed == ()


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm")
def test_a_sigkilled_shm_broadcaster_leaves_no_segments_after_the_next_one_starts():
    from asyncrl.weights.shm import ShmWeightBroadcaster

    proc, path = _start(_SHM_BROADCASTER)
    try:
        assert path.parent == Path("/dev/shm") and any(path.glob("*.seg"))
    finally:
        _kill(proc)
    assert any(path.glob("*.seg")), "SIGKILL skips the broadcaster's cleanup"
    b = ShmWeightBroadcaster(bucket_bytes=1 << 16)
    try:
        assert not path.exists(), "the next broadcaster removes a dead one's segments"
        stats = b.stats()
        assert stats["stale_dirs_removed"] >= 1 and stats["stale_bytes_removed"] >= 2 << 20
    finally:
        b.close()
    assert not Path(b.address).exists()


_KILLED_IN_CLOSE = """
import os, signal, sys
from asyncrl._owned_dir import make_owned_dir
d, _ = make_owned_dir(sys.argv[1], sys.argv[2])
for name in ("committed-1.json", "latest.json", "slot-0", "slot-1"):
    (d.path / name).write_bytes(b"z" * 4096)
calls, at = [0], int(sys.argv[3])
real = {"unlink": os.unlink, "rename": os.rename, "rmdir": os.rmdir}
def dies(name):
    def call(*args, **kwargs):
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)  # torchrun's group kill, at this step of the removal
        calls[0] += 1
        return real[name](*args, **kwargs)
    return call
os.unlink, os.rename, os.rmdir = dies("unlink"), dies("rename"), dies("rmdir")
d.close()
"""


@pytest.mark.parametrize("step", range(7))  # rename, four files, .owner, rmdir
def test_a_kill_at_any_step_of_a_removal_leaves_nothing_unowned_in_sight_and_the_next_maker_sweeps_it(tmp_path, step):
    proc = subprocess.run([sys.executable, "-c", _KILLED_IN_CLOSE, PREFIX, str(tmp_path), str(step)], timeout=60,
                          check=False)
    assert proc.returncode == -signal.SIGKILL
    for path in tmp_path.iterdir():  # either visible with its .owner (lock free now), or hidden as half removed
        assert path.name.startswith(f".{PREFIX}gone-") or (path / OWNER).exists(), f"{path} lost its owner in sight"
    mine, swept = make_owned_dir(PREFIX, tmp_path)  # no grace to wait for: a half-removed directory is swept at once
    try:
        assert [p for p in tmp_path.iterdir() if p != mine.path] == [], f"left after the sweep: {swept}"
        assert swept.legacy == ()
    finally:
        mine.close()
    assert list(tmp_path.iterdir()) == []


def test_an_old_directory_without_owner_is_removed_only_when_no_process_uses_it(tmp_path):
    old = time.time() - 2 * UNLOCKED_GRACE_S
    # e.g. left by an older asyncrl whose removal began with .owner
    unused, used = tmp_path / f"{PREFIX}unused", tmp_path / f"{PREFIX}used"
    for path in (unused, used):
        path.mkdir()
        (path / "seg").write_bytes(b"y" * 8192)
        os.utime(path, (old, old))
    code = "import sys, time; f = open(sys.argv[1], 'rb'); print(1, flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(used / "seg")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        swept = sweep_dead(PREFIX, tmp_path)
        assert [p for p, _ in swept.removed] == [str(unused)] and not unused.exists()
        assert [p for p, _ in swept.legacy] == [str(used)] and used.exists(), "a live reader's directory must stay"
    finally:
        _kill(holder)
    assert [p for p, _ in sweep_dead(PREFIX, tmp_path).removed] == [str(used)] and not used.exists()


def test_a_forked_child_closing_its_copy_leaves_the_parents_directory(tmp_path):
    mine, _ = make_owned_dir(PREFIX, tmp_path)
    try:
        pid = os.fork()
        if pid == 0:  # the child's finalizer at its exit, e.g. a forked helper process
            mine.close()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert mine.path.is_dir() and (mine.path / OWNER).exists()
        assert sweep_dead(PREFIX, tmp_path).removed == (), "the parent still holds the lock"
    finally:
        mine.close()
    assert not mine.path.exists()
