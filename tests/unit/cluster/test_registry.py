"""The pools' records: written whole, read as one complete set of one incarnation, nothing secret in them."""

from __future__ import annotations

import pytest

from asyncrl.cluster.registry import (advertise, complete_records, pool_record, read_pool_records, wait_pool_records,
                                      write_allow_list, write_pool_record)
from asyncrl.config import TransportConfig, WorkerConfig, to_dict
from asyncrl.transport.zmq import generate_curve_keys, read_curve_keys_file


def _record(rank, world, incarnation, written):
    public, secret = generate_curve_keys()
    transport = to_dict(TransportConfig(bind="tcp://0.0.0.0:0", curve_public_key=public, curve_secret_key=secret,
                                        curve_allowed_keys=[generate_curve_keys()[0]]))
    rec = pool_record(rank=rank, world_size=world, incarnation=incarnation, endpoint=f"tcp://0.0.0.0:{5000 + rank}",
                      transport=transport, worker=to_dict(WorkerConfig()),
                      weights={"type": "zmq", "address": "tcp://0.0.0.0:6000", "delta": True})
    return {**rec, "written": written}, secret


def test_a_record_carries_no_secret_and_advertises_wildcards(monkeypatch):
    monkeypatch.setenv("ASYNCRL_ADVERTISE_HOST", "node-a")
    rec, secret = _record(0, 1, "inc", 1.0)
    assert secret not in repr(rec) and "curve_allowed_keys" not in rec["transport"] and "bind" not in rec["transport"]
    assert rec["endpoint"] == "tcp://node-a:5000" and rec["weights"]["address"] == "tcp://node-a:6000"
    assert rec["worker"]["weights"]["address"] == "tcp://node-a:6000" and len(rec["server_key"]) == 40
    assert advertise("tcp://10.0.0.1:5") == "tcp://10.0.0.1:5" and advertise("ipc:///x") == "ipc:///x"


def test_complete_set_of_the_newest_incarnation(tmp_path):
    old = [_record(r, 2, "old", 1.0)[0] for r in range(2)]
    new0 = _record(0, 2, "new", 2.0)[0]
    assert complete_records(old)[1]["rank"] == 1
    assert complete_records([*old, new0]) is None  # the restarted gang's rank 1 is not up yet: never mixed
    for rec in old:
        write_pool_record(tmp_path, rec)
    assert [r["incarnation"] for r in wait_pool_records(tmp_path, timeout_s=1)] == ["old", "old"]
    write_pool_record(tmp_path, new0)
    with pytest.raises(TimeoutError, match="ranks"):
        wait_pool_records(tmp_path, timeout_s=0.2, poll_s=0.05)
    write_pool_record(tmp_path, _record(1, 2, "new", 3.0)[0])
    assert [r["incarnation"] for r in wait_pool_records(tmp_path / "cluster", timeout_s=1)] == ["new", "new"]
    assert len(read_pool_records(tmp_path)) == 2


def test_allow_list_file_round_trip(tmp_path):
    keys = [generate_curve_keys()[0] for _ in range(3)]
    write_allow_list(tmp_path / "allowed", keys)
    assert read_curve_keys_file(str(tmp_path / "allowed")) == sorted(keys)
    with pytest.raises(ValueError, match="40 Z85"):
        write_allow_list(tmp_path / "allowed", ["short"])
