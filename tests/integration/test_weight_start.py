"""asyncrl.weights.start: rank 0 alone owns the broadcaster, every rank gets its address; shm's run directory."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config import TransportConfig, WeightSyncConfig
from asyncrl.weights.start import shm_directory, start_weight_sync

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


def _ranks(rank: int, world: int, init: str, run_dir: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        sync = start_weight_sync(WeightSyncConfig(type="shm", bucket_bytes=1 << 16), run_dir=run_dir,
                                 device=torch.device("cpu"))
        out[rank] = (sync.broadcaster is not None, str(sync.address))
        dist.barrier()
        sync.close()
    finally:
        dist.destroy_process_group()


def test_shm_rank_0_owns_the_broadcaster_and_every_rank_gets_its_address(tmp_path):
    run_dir = tmp_path / "run"
    directory = shm_directory(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "segment-of-a-killed-run").write_bytes(b"x")  # a killed run's leftover is replaced on resume
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ranks, args=(2, f"file://{tmp_path / 'store'}", str(run_dir), out), nprocs=2, join=True)
        results = dict(out)
    assert results[0][0] and not results[1][0], results
    assert results[0][1] == results[1][1] == str(directory), results
    assert not directory.exists()  # close() on rank 0 removed it


def test_shm_directory_is_per_run_and_stable(tmp_path):
    assert shm_directory(tmp_path / "a") == shm_directory(tmp_path / "a")
    assert shm_directory(tmp_path / "a") != shm_directory(tmp_path / "b")


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_zmq_gets_the_rollout_channels_security(one_rank, tmp_path):
    cfg = WeightSyncConfig(type="zmq", bind="tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="beyond loopback without authentication"):
        start_weight_sync(cfg, run_dir=tmp_path, device=torch.device("cpu"))  # no keys: refused
    sync = start_weight_sync(cfg, run_dir=tmp_path, device=torch.device("cpu"),
                             security=TransportConfig(allow_insecure_remote=True))
    try:
        assert sync.address.startswith("tcp://") and sync.broadcaster is not None
    finally:
        sync.close()


def test_an_unknown_type_is_refused_with_the_choices(one_rank, tmp_path):
    with pytest.raises(ValueError, match="unknown weight sync"):
        start_weight_sync(WeightSyncConfig(type="none"), run_dir=tmp_path, device=torch.device("cpu"))


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_delta_threads_must_be_a_positive_integer(threads):
    with pytest.raises(ValueError, match=rf"weights.delta_threads={threads!r} must be an integer >= 1"):
        WeightSyncConfig(type="zmq", delta=True, delta_threads=threads)


def test_zmq_broadcaster_gets_the_delta_threads(one_rank, tmp_path):
    sync = start_weight_sync(WeightSyncConfig(type="zmq", delta=True, delta_threads=2), run_dir=tmp_path,
                             device=torch.device("cpu"))
    try:
        assert len(sync.broadcaster._encoder._threads) == 2  # the pass-through is the point
    finally:
        sync.close()
