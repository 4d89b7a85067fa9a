"""Weight sync: broadcaster (trainer) and receiver (worker) ends; see ``base.py``.

Backends: ``zmq`` (:mod:`asyncrl.weights.zmq`, any machine a socket reaches), ``shm``
(:mod:`asyncrl.weights.shm`, receivers on the broadcaster's machine), ``nccl``
(:mod:`asyncrl.weights.nccl`, a process group of the channel's own: NCCL on GPUs, gloo on CPUs) and
``cuda_ipc`` (:mod:`asyncrl.weights.cuda_ipc`, GPU receivers on the trainer's node). Pick one with
:func:`setup_weight_broadcaster` / :func:`setup_weight_receiver`.
"""

from __future__ import annotations

from typing import Any, Literal

from asyncrl.weights.base import (
    Bucket,
    TensorSlot,
    WeightBroadcaster,
    WeightReceiver,
    WeightSyncError,
    WeightUpdate,
    bucket_checksum,
    plan_buckets,
)
from asyncrl.weights.cuda_ipc import CudaIpcWeightBroadcaster, CudaIpcWeightReceiver
from asyncrl.weights.nccl import NcclWeightBroadcaster, NcclWeightReceiver
from asyncrl.weights.shm import ShmWeightBroadcaster, ShmWeightReceiver
from asyncrl.weights.zmq import ZmqWeightBroadcaster, ZmqWeightReceiver

__all__ = [
    "Bucket",
    "CudaIpcWeightBroadcaster",
    "CudaIpcWeightReceiver",
    "NcclWeightBroadcaster",
    "NcclWeightReceiver",
    "ShmWeightBroadcaster",
    "ShmWeightReceiver",
    "TensorSlot",
    "WeightBroadcaster",
    "WeightReceiver",
    "WeightSyncError",
    "WeightUpdate",
    "ZmqWeightBroadcaster",
    "ZmqWeightReceiver",
    "bucket_checksum",
    "plan_buckets",
    "setup_weight_broadcaster",
    "setup_weight_receiver",
]

WeightSyncType = Literal["zmq", "shm", "nccl", "cuda_ipc"]
_BROADCASTERS: dict[str, type[WeightBroadcaster]] = {
    "zmq": ZmqWeightBroadcaster, "shm": ShmWeightBroadcaster, "nccl": NcclWeightBroadcaster,
    "cuda_ipc": CudaIpcWeightBroadcaster,
}
_RECEIVERS: dict[str, type[WeightReceiver]] = {
    "zmq": ZmqWeightReceiver, "shm": ShmWeightReceiver, "nccl": NcclWeightReceiver,
    "cuda_ipc": CudaIpcWeightReceiver,
}


def _pick(table: dict[str, Any], type: str) -> Any:
    if type not in table:
        raise ValueError(f"unknown weight sync {type=}; choose 'zmq' (across machines), 'shm' (same machine) or "
                         "'nccl' (a process group of its own: NCCL on GPUs, gloo on CPUs) or 'cuda_ipc' (GPU receivers on this "
                         "node)")
    return table[type]


def setup_weight_broadcaster(type: WeightSyncType, **kwargs: Any) -> WeightBroadcaster:
    """The trainer end of backend ``type``; ``kwargs`` go to its constructor (``bind``/``directory``, ...)."""
    return _pick(_BROADCASTERS, type)(**kwargs)


def setup_weight_receiver(type: WeightSyncType, address: str, **kwargs: Any) -> WeightReceiver:
    """The worker end of backend ``type`` for a broadcaster's ``address`` (not started)."""
    return _pick(_RECEIVERS, type)(address, **kwargs)
