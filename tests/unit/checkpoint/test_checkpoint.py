"""asyncrl.checkpoint.checkpointer: a kill at any point of a save (simulated by raising from the hook after each step,
and while ranks are still writing) leaves a run that resumes from a complete checkpoint; nothing `latest`
names is ever deleted; a broken `latest` falls back to the newest complete checkpoint, saying so."""

from __future__ import annotations

import json

import pytest

from asyncrl.checkpoint.checkpointer import LATEST, SAVE_POINTS, CheckpointDir, rank_files

WORLD = 2


class Killed(Exception):
    pass


def _save(root, step: int, *, kill_at: str | None = None, keep: int = 2) -> None:
    """One save as the recipe does it (rank 0 stages, every rank writes, rank 0 commits); ``kill_at`` raises
    after that point (``"writing"``: half the ranks' files written)."""
    def hook(point: str, s: int) -> None:
        if point == kill_at:
            raise Killed(point)

    ckpt = CheckpointDir(root, world_size=WORLD, keep=keep, hook=hook)
    tmp = ckpt.stage(step)
    for i, name in enumerate(rank_files(WORLD)):
        if kill_at == "writing" and i == 2:
            raise Killed("writing")
        (tmp / name).write_text(str(step))
    ckpt.commit(tmp, step)


def _resumed_step(root) -> int | None:
    ckpt = CheckpointDir(root, world_size=WORLD)
    named = ckpt.latest_named()
    if named is not None:  # the invariant: latest never names a missing or incomplete checkpoint
        assert ckpt.why_incomplete(named) is None, f"latest names {named.name}: {ckpt.why_incomplete(named)}"
    path, _ = ckpt.resolve()
    if path is None:
        return None
    assert ckpt.why_incomplete(path) is None
    return int((path / "trainer-rank1.pt").read_text())


SCENARIOS = {
    "first save": [],
    "next save": [1, 2],
    "re-save of the step latest names": [1, 2, 3],  # checkpoint.every=1: the final step saved twice
    "re-save of an unnamed step": [1, 2, 3],  # a dead timeline's step-3 (renamed, never pointed at)
}


@pytest.mark.parametrize("kill_at", ["writing", *SAVE_POINTS])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_kill_at_any_point_of_a_save_leaves_a_complete_checkpoint(tmp_path, scenario, kill_at):
    root = tmp_path / "checkpoints"
    for step in SCENARIOS[scenario]:
        _save(root, step)
    if scenario == "re-save of an unnamed step":
        CheckpointDir(root, world_size=WORLD).point_latest(root / "step-000002")
    before = _resumed_step(root)
    step = 3 if scenario.startswith("re-save") else (SCENARIOS[scenario] or [0])[-1] + 1
    with pytest.raises(Killed):
        _save(root, step, kill_at=kill_at)
    after = _resumed_step(root)
    assert after in {before, step} - {None} or (before is None and after is None), (before, after)
    if kill_at in ("pointed", "pruned"):
        assert after == step  # latest moved: the new checkpoint is the one resumed
    # and the run goes on: the next save commits and prunes without touching what latest names
    _save(root, step + 1)
    assert _resumed_step(root) == step + 1
    assert 1 <= len(CheckpointDir(root, world_size=WORLD).complete()) <= 2  # keep=2
    assert not list(root.glob(".step-*.tmp"))


def test_a_re_save_goes_to_a_new_name_before_latest_moves(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 3)
    seen = []

    def hook(point, step):
        seen.append((point, (root / LATEST).read_text(), sorted(p.name for p in root.glob("step-*"))))

    ckpt = CheckpointDir(root, world_size=WORLD, hook=hook)
    tmp = ckpt.stage(3)
    for name in rank_files(WORLD):
        (tmp / name).write_text("3")
    final = ckpt.commit(tmp, 3)
    assert final.name == "step-000003.1"
    renamed = dict((p, (latest, names)) for p, latest, names in seen)["renamed"]
    assert renamed == ("step-000003", ["step-000003", "step-000003.1"])  # both exist while latest moves
    assert (root / LATEST).read_text() == "step-000003.1"


def test_pruning_never_deletes_what_latest_names(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(root, step, keep=1)
    ckpt = CheckpointDir(root, world_size=WORLD, keep=1)
    ckpt.point_latest(root / "step-000003")
    assert [p.name for p in ckpt.complete()] == ["step-000003"]
    # a resumed run that points latest at an older checkpoint keeps it while newer dead ones go
    _save(root, 4, keep=1)
    ckpt.point_latest(root / "step-000004")
    assert ckpt.prune() == []


@pytest.mark.parametrize("damage", ["missing", "no .metadata", "no loader file of rank 1", "bad marker"])
def test_a_broken_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, damage):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        _save(root, step)
    ckpt = CheckpointDir(root, world_size=WORLD)
    if damage == "missing":
        ckpt.point_latest(root / "step-000016")  # what the old double save left after a kill
    elif damage == "no .metadata":
        (root / "step-000002" / ".metadata").unlink()
    elif damage == "no loader file of rank 1":
        (root / "step-000002" / "loader-rank1.pt").unlink()
    else:
        (root / "step-000002" / "COMPLETE").write_text("{")
    path, note = ckpt.resolve()
    expected = "step-000002" if damage == "missing" else "step-000001"
    assert path == root / expected
    assert "latest names step-0000" in note and f"newest complete checkpoint, {expected}" in note, note
    print(note)


def test_a_checkpoint_without_a_marker_is_complete_with_every_ranks_files(tmp_path):
    legacy = tmp_path / "step-000005"
    legacy.mkdir()
    for name in rank_files(WORLD):
        (legacy / name).write_text("5")
    ckpt = CheckpointDir(tmp_path, world_size=WORLD)
    assert ckpt.why_incomplete(legacy) is None
    assert "trainer-rank2.pt" in CheckpointDir(tmp_path, world_size=3).why_incomplete(legacy)
    ckpt.point_latest(legacy)
    assert ckpt.resolve() == (legacy, "")


def test_the_marker_lists_every_ranks_files(tmp_path):
    _save(tmp_path, 7)
    marker = json.loads((tmp_path / "step-000007" / "COMPLETE").read_text())
    assert marker["step"] == 7 and marker["world_size"] == WORLD and set(rank_files(WORLD)) <= set(marker["files"])
