"""asyncrl.checkpoint.Checkpointer in one process (any loop's checkpoints): a save/load round trip restores
model, optimizer, RNG, step, policy version, extra and the loader's state; a step already on disk is not saved
twice; a kill inside a save resumes from the previous complete checkpoint; asyncrl.checkpoint.run_dir's helpers for the
lock and the records work without a process group."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.checkpoint.checkpointer import Checkpointer
from asyncrl.checkpoint.run_dir import RunDirLocked, continue_records, hold_run_dir, record_files


class FakeLoader:
    def __init__(self, state: dict | None = None):
        self.state = state or {"consumed": [1, 2, 3]}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _train(model, opt, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_round_trip_restores_everything(tmp_path):
    torch.manual_seed(0)
    model, loader = torch.nn.Linear(3, 2), FakeLoader()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    ckpt = Checkpointer(tmp_path / "ckpt", model, opt, loader)
    path = ckpt.save(3, 2, extra={"note": "x"}, files={"config.json": b"{}"})
    assert path is not None and (path / "config.json").read_bytes() == b"{}"
    expected_draw = torch.rand(3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_exp_avg = opt.state[model.weight]["exp_avg"].clone()

    torch.manual_seed(123)
    model2, loader2 = torch.nn.Linear(3, 2), FakeLoader({"consumed": []})
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ckpt2 = Checkpointer(tmp_path / "ckpt", model2, opt2, loader2)
    latest = ckpt2.resolve()
    state = ckpt2.load(latest)
    assert (state.step, state.policy_version, state.extra, state.path) == (3, 2, {"note": "x"}, latest)
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in want.items())
    assert torch.equal(opt2.state[model2.weight]["exp_avg"], want_exp_avg)
    assert loader2.state == {"consumed": [1, 2, 3]}
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the saved run's did
    assert ckpt2.save(3, 2) is None  # on disk already


def test_a_kill_inside_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    class Killed(Exception):
        pass

    def hook(point: str, step: int) -> None:
        if step == 2 and point == "renamed":
            raise Killed(point)

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path / "ckpt", model, opt, FakeLoader(), hook=hook)
    ckpt.save(1, 1)
    _train(model, opt, 1)
    with pytest.raises(Killed):
        ckpt.save(2, 2)
    resumed = Checkpointer(tmp_path / "ckpt", torch.nn.Linear(3, 2), opt, FakeLoader())
    assert resumed.resolve().name == "step-000001"


def test_a_save_without_the_loader_says_how_to_attach_it(tmp_path):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="needs the loader"):
        Checkpointer(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1)).save(1, 0)


def _as_if_saved_by_two_ranks(path) -> None:
    """Makes a one-rank checkpoint look like a two-rank one: rank 1's files (its own loader state) and the marker."""
    torch.save({"consumed": [7]}, path / "loader-rank1.pt")
    trainer = torch.load(path / "trainer-rank0.pt", weights_only=True)
    torch.save({**trainer, "rng": torch.ByteTensor(trainer["rng"].numel()).zero_()}, path / "trainer-rank1.pt")
    marker = json.loads((path / "COMPLETE").read_text())
    marker.update(world_size=2, files=[*marker["files"], "loader-rank1.pt", "trainer-rank1.pt"])
    (path / "COMPLETE").write_text(json.dumps(marker))


def test_a_checkpoint_of_another_world_size_resumes_with_every_ranks_loader_state(tmp_path, capsys):
    """At another number of ranks than saved, the loader gets the list of every saved rank's state (it re-deals them:
    tests/unit/pool/test_reshard.py), a new rank takes the trainer state of saved rank ``rank % saved``; a missing trainer
    file is a damaged checkpoint."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = Checkpointer(tmp_path, model, opt, FakeLoader()).save(4, 3, extra={"note": "x"})
    _as_if_saved_by_two_ranks(path)
    loader = FakeLoader({})
    ckpt = Checkpointer(tmp_path, model, opt, loader)
    assert ckpt.dir.world_size_of(path) == 2 and ckpt.resolve() == path
    state = ckpt.load(path)
    assert (state.step, state.policy_version, state.extra) == (4, 3, {"note": "x"})
    assert loader.state == [{"consumed": [1, 2, 3]}, {"consumed": [7]}]
    assert "saved at 2 trainer ranks, this run has 1" in capsys.readouterr().err
    (path / "trainer-rank0.pt").unlink()
    with pytest.raises(FileNotFoundError, match="damaged checkpoint"):
        Checkpointer(tmp_path, model, opt, FakeLoader()).load(path)


def test_run_dir_helpers_without_a_process_group(tmp_path):
    lock = hold_run_dir(tmp_path)
    try:
        assert lock is not None and lock.held
        # a second holder in this process is refused too (flock is per open file description)
        with pytest.raises(RunDirLocked, match="in use by another run"):
            hold_run_dir(tmp_path)
    finally:
        lock.release()
    files = record_files(tmp_path, 0)
    files[0].write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    continue_records(files, 3)
    assert [json.loads(line)["step"] for line in files[0].read_text().splitlines()] == [1, 2, 3]


def test_a_resume_at_fewer_ranks_rolls_back_the_records_of_the_ranks_it_no_longer_has(tmp_path):
    """Saved at 3 ranks at step 2, killed at step 4, resumed at 1: rank 0 also truncates ranks 1 and 2's files (their
    steps 3-4 were rolled back and will be trained by rank 0), and leaves them alone at the same size."""
    for rank in range(3):
        for name in (f"consumed-rank{rank}.jsonl", f"debug/steps-rank{rank}.jsonl"):
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    assert record_files(tmp_path, 0, 3) == record_files(tmp_path, 0)
    assert record_files(tmp_path, 1, 1) == record_files(tmp_path, 1)  # only rank 0 looks after the others
    continue_records(record_files(tmp_path, 0, 1), 2)
    for rank in range(3):
        for name in (f"consumed-rank{rank}.jsonl", f"debug/steps-rank{rank}.jsonl"):
            assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [1, 2], name
