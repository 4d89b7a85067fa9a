"""A worker outside Ray joins a Ray-launched run through its registry actor (``asyncrl worker --ray-address ADDR
--run-name NAME --client-key-file KEY``): it asks to join with its public key, waits until the supervisor has
authorized it in every pool's allow-list, then reads the pools' records and disconnects from Ray before serving.
Only the public key crosses Ray."""

from __future__ import annotations

import time
from typing import Any

import ray

__all__ = ["lookup_records"]


def lookup_records(address: str, run_name: str, *, namespace: str = "asyncrl", timeout_s: float = 300.0,
                   worker_id: str | None = None, public_key: str | None = None,
                   not_incarnation: str | None = None) -> list[dict[str, Any]]:
    """The run's complete pool records from its registry, after authorizing ``public_key`` (when given); of another
    incarnation than ``not_incarnation`` (a worker that lost that gang waits for the one the supervisor restarts).

    Raises:
        TimeoutError: no registry, no authorization or no complete set of records within ``timeout_s``.
    """
    name = f"asyncrl-registry-{run_name}"
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
    try:
        deadline = time.monotonic() + timeout_s
        registry = None
        while registry is None:
            try:
                registry = ray.get_actor(name)
            except ValueError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no registry {name!r} in namespace {namespace!r} on {address} within "
                                       f"{timeout_s:.0f} s: is the run launched (asyncrl launch --engine ray)?") from None
                time.sleep(0.5)
        if public_key is not None:
            ray.get(registry.request_join.remote(worker_id, public_key))
            while not ray.get(registry.authorized.remote(worker_id)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"registry {name!r}: worker {worker_id} not authorized within {timeout_s:.0f} s")
                time.sleep(0.2)
        while (records := ray.get(registry.records.remote())) is None or records[0]["incarnation"] == not_incarnation:
            if time.monotonic() > deadline:
                raise TimeoutError(f"registry {name!r}: the pools' records are not complete within {timeout_s:.0f} s")
            time.sleep(0.5)
        return records
    finally:
        ray.shutdown()
