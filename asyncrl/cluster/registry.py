"""The pools' records: how a worker finds every trainer rank's pool without anyone typing an endpoint or a key.

Each trainer rank of a run launched beyond ``local`` writes one record once its pool is bound::

    {"rank": r, "world_size": W, "incarnation": "...", "endpoint": "tcp://10.0.0.5:41234",
     "server_key": "<the pools' CURVE public key, Z85>", "weights": {"type": "zmq", "address": "tcp://..."},
     "host": "node-a"}

into ``<run_dir>/cluster/pools/rank{r}.json`` (written whole, then renamed). A worker reads a complete set: one record
per rank, all of one incarnation (a restarted gang's records replace the dead one's; a reader never mixes them).
Under Slurm the run directory is on shared storage and ``asyncrl worker --registry DIR`` reads the files; under Ray
each rank's actor copies its record into the run's named registry actor (:mod:`asyncrl.integrations.ray.registry`),
and a worker outside Ray can read either. Only public keys are in a record.

The allow-list a pool watches (``transport.curve_allowed_keys_file``) is written with :func:`write_allow_list`: whole,
then renamed, so the pool never reads half a file.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from asyncrl.codec import dumps_json, loads_json

__all__ = ["POOLS", "advertise", "complete_records", "pool_record", "pool_record_path", "read_pool_records", "wait_pool_records",
           "write_allow_list", "write_pool_record"]

POOLS = Path("cluster") / "pools"
"""Where, under the run directory, each rank's record is written."""
REQUIRED = ("rank", "world_size", "incarnation", "endpoint", "server_key", "weights")


SECRET_TRANSPORT_KEYS = ("curve_secret_key", "curve_public_key", "curve_client_secret_key", "curve_client_key_file",
                         "curve_allowed_keys", "curve_allowed_keys_file", "curve_allow_any_client", "bind")
"""Transport settings a record's ``transport`` never carries: the pool's own keys (its public key is the record's
``server_key``), the pool's allow-list and its bind address; what remains are the settings both ends share."""


def advertise(endpoint: str, host: str | None = None) -> str:
    """``endpoint`` as other hosts dial it: a wildcard bind (``tcp://0.0.0.0:P``, ``tcp://*:P``) becomes
    ``tcp://HOST:P`` (``host``, else ``$ASYNCRL_ADVERTISE_HOST``, else this host's name)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            import socket

            host = host or os.environ.get("ASYNCRL_ADVERTISE_HOST") or socket.gethostname()
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


def pool_record(*, rank: int, world_size: int, incarnation: str, endpoint: str, transport: dict[str, Any],
                worker: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """A rank's record: what a worker needs to serve it, and nothing secret.

    Args:
        rank, world_size, incarnation: the rank, the gang's size and this start of the run.
        endpoint: the pool's bound endpoint (a wildcard host is advertised as this host's).
        transport: the rollout channel's settings (``to_dict``); the public key stays, secrets and the allow-list go.
        worker: the workers' settings (``to_dict`` of the ``rollout.worker`` the recipe hands its local workers:
            engine with the model directory, reward, weights with the broadcaster's address).
        weights: ``{"type", "address", "delta"}`` of the run's weight channel (the broadcaster's, advertised).
    """
    server_key = transport.get("curve_public_key")
    public = {k: v for k, v in transport.items() if k not in SECRET_TRANSPORT_KEYS}
    weights = {**weights, "address": advertise(weights["address"]) if weights.get("address") else None}
    worker = {**worker, "weights": {**worker.get("weights", {}), "address": weights["address"]}}
    import socket

    return {"rank": rank, "world_size": world_size, "incarnation": incarnation, "endpoint": advertise(endpoint),
            "server_key": server_key, "weights": weights, "transport": public, "worker": worker,
            "host": socket.gethostname(), "pid": os.getpid()}


def pool_record_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / POOLS / f"rank{rank}.json"


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # writers in threads: one each
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_pool_record(run_dir: str | Path, record: dict[str, Any]) -> Path:
    """Writes one rank's record (see the module docstring), whole then renamed; returns its path.

    Raises:
        ValueError: a record missing one of the required keys.
    """
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"a pool record needs {missing}; got {sorted(record)}")
    path = pool_record_path(run_dir, int(record["rank"]))
    _atomic_write(path, dumps_json({**record, "written": record.get("written", time.time())}))
    return path


def read_pool_records(directory: str | Path) -> list[dict[str, Any]]:
    """Every record under ``directory`` (a run directory, its ``cluster/`` or ``cluster/pools``), unchecked."""
    directory = Path(directory)
    for candidate in (directory / POOLS, directory / "pools", directory):
        if candidate.is_dir() and any(candidate.glob("rank*.json")):
            return [loads_json(p.read_bytes()) for p in sorted(candidate.glob("rank*.json"))]
    return []


def complete_records(records: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The records of one complete set, sorted by rank: one per rank of ``world_size``, all of the newest
    incarnation among them (a restarted gang's); None while a rank is missing."""
    if not records:
        return None
    newest = max(records, key=lambda r: r.get("written", 0.0))["incarnation"]
    mine = {r["rank"]: r for r in records if r["incarnation"] == newest}
    world = next(iter(mine.values()))["world_size"]
    if sorted(mine) != list(range(world)):
        return None
    return [mine[r] for r in range(world)]


def wait_pool_records(directory: str | Path, timeout_s: float = 300.0, poll_s: float = 0.2, *,
                      not_incarnation: str | None = None) -> list[dict[str, Any]]:
    """Waits for a complete set of records under ``directory`` (:func:`complete_records`), of another incarnation than
    ``not_incarnation`` (a worker that lost that trainer waits for the next one).

    Raises:
        TimeoutError: naming the directory and the ranks found, after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_pool_records(directory)
        done = complete_records(records)
        if done is not None and done[0]["incarnation"] != not_incarnation:
            return done
        if time.monotonic() > deadline:
            raise TimeoutError(f"no complete set of pool records under {directory} within {timeout_s:.0f} s (found "
                               f"ranks {sorted(r['rank'] for r in records)}): are the trainer ranks up, and is the "
                               "run directory on storage this host shares with them?")
        time.sleep(poll_s)


def write_allow_list(path: str | Path, keys: list[str] | set[str]) -> None:
    """Writes a pool's allow-list file (``transport.curve_allowed_keys_file``: one Z85 public key a line), whole then
    renamed; a pool watching it admits exactly these keys from then on."""
    bad = [k for k in keys if len(k) != 40]
    if bad:
        raise ValueError(f"CURVE public keys are 40 Z85 characters; got {bad[:3]}")
    _atomic_write(Path(path), ("# asyncrl allow-list: worker CURVE public keys\n"
                               + "".join(f"{k}\n" for k in sorted(keys))).encode())
