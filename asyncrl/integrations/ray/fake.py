"""A Ray cluster of fake nodes on this machine, every byte on loopback: for tests and benchmarks, not production.

``ray.cluster_utils.Cluster`` starts a head and one raylet per fake node, each with its own logical resources
(``num_gpus``, ``asyncrl_trainer``, ``asyncrl_rollout``), all on this machine. Two things keep it on loopback: every
node's ``node_ip_address`` is ``127.0.0.1``, and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (set in the environment for
Ray's children, and Ray's constant patched in this process, whatever imported Ray first), without which Ray resolves
127.0.0.1 to the machine's interface address when a driver connects. Ray's own daemons still listen on every interface
(Ray 2.60 has no bind address for them): run this on a machine whose network you trust, as any Ray cluster.

Its workers run at niceness 0 (``RAY_worker_niceness=0``, unless the environment sets it), as torchrun's processes and
Ray Jobs' drivers do: by default Ray starts every worker process at niceness 15, asyncrl's trainer ranks and rollout
workers (children of Ray actors) inherit it, and on one machine whose CPUs the fake nodes share, Ray's own daemons
then preempt the run, which a comparison with torchrun on this machine measures (``benchmarks/cluster_launch.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402

__all__ = ["fake_cluster", "node_args"]

OBJECT_STORE_BYTES = 80 * 1024 * 1024


def node_args(num_cpus: float = 1, num_gpus: float = 0, **resources: float) -> dict[str, Any]:
    """``Cluster.add_node`` arguments of a fake node on loopback with these logical resources."""
    return dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources, node_ip_address="127.0.0.1",
                object_store_memory=OBJECT_STORE_BYTES)


@contextlib.contextmanager
def fake_cluster(nodes: dict[str, dict[str, Any]], *, namespace: str = "asyncrl") -> Iterator[tuple[Any, dict]]:
    """A head (1 CPU, no custom resources) plus ``nodes`` (name -> :func:`node_args`), the driver connected;
    yields ``(cluster, {name: node})`` and shuts everything down after."""
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    os.environ.setdefault("RAY_worker_niceness", "0")  # read by each raylet as it starts: see the module's docstring
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, node_ip_address="127.0.0.1",
                                                                include_dashboard=False,
                                                                object_store_memory=OBJECT_STORE_BYTES))
    try:
        added = {name: cluster.add_node(**args) for name, args in nodes.items()}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()
        constants.ENABLE_RAY_CLUSTER = saved
