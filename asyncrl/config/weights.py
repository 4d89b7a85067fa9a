"""The ``weights`` section: how the trainer's weights reach rollout workers (``asyncrl.weights``); and ``relay``, the
settings of a node's weight relay (``asyncrl relay``, :mod:`asyncrl.weights.relay`).

Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RelayConfig", "WeightSyncConfig"]


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How a worker receives weights (and where the trainer's broadcaster binds)."""

    type: Literal["none", "zmq", "shm", "nccl", "cuda_ipc"] = "none"
    """``none``: no weight sync (the fake engine follows the pool's version); ``zmq``: across machines;
    ``shm``: shared memory, same machine; ``nccl``: a process group of the weight channel's own
    (:mod:`asyncrl.weights.nccl`: NCCL with CUDA buckets, gloo with CPU buckets; the address is
    the broadcaster's control endpoint, bound like ``bind``); ``cuda_ipc``: GPU receivers on the trainer's node
    (:mod:`asyncrl.weights.cuda_ipc`: two persistent GPU slots opened once by each receiver; the address
    is the broadcaster's ``ipc://`` control endpoint; CUDA only)."""
    address: str | None = None
    """Worker side: the broadcaster's address (endpoint for zmq, directory for shm)."""
    relay: str | None = None
    """Worker side: the directory of this worker's node relay (``asyncrl relay --serve-shm DIR``,
    :mod:`asyncrl.weights.relay`): the worker reads every version from the relay, which fetched it once for the node,
    and from the broadcaster at ``address`` (``type: zmq``) only while the relay is down. Which workers share a node
    is declared here, by the launcher that placed them (remote workers: your command line; the Ray launcher: the
    node it chose); local workers are on the trainer's node and use ``shm`` instead. None: no relay."""
    bind: str = "tcp://127.0.0.1:0"
    """Trainer side, zmq: where the broadcaster binds."""
    bucket_bytes: int = 64 * 1024 * 1024
    """Transfer unit: bounds memory in flight per receiver."""
    delta: bool = False
    """Send each bucket as a delta against the version the receiver committed (sparse positions + XOR values,
    or zstd'd XOR, whichever is smaller; :mod:`asyncrl.weights.delta`) when that is smaller than the bucket;
    receivers without that base (late joiners, skipped versions, another incarnation) get full buckets. Costs
    each receiver one more copy of the weights (the base) and both ends CPU time per bucket; pays off on links
    slower than memory: ``zmq`` only (``shm`` receivers verify and load the shared segment in place, with no
    per-receiver bytes a delta could save; there it is ignored). Set it on the trainer and the workers alike."""
    delta_threads: int = 1
    """``zmq`` with ``delta``, trainer side: the broadcaster's encoder threads (a version's buckets are encoded in
    parallel across them, :mod:`asyncrl.weights._delta_encoder`). 1 by default: on a 2-core machine 2 threads
    cost more CPU (contention) and were slower end to end (``benchmarks/weight_delta.py --delta-threads 1,2``:
    one thread already overlaps encoding with the sends and the receivers' decoding); more may pay on a trainer
    with idle cores and many buckets."""
    wait_for_first_s: float = 60.0
    """A worker waits up to this long for the current weights before it generates (late joiners)."""
    catch_up_s: float = 10.0
    """A worker leased prompts at a newer policy version than its weights waits up to this long for that
    version's weights before generating (then generates with what it has; the pool judges staleness)."""
    verify: Literal["off", "sampled", "full"] = "sampled"
    """Post-sync verification (:mod:`asyncrl.weights.verify`): after applying an update the worker compares
    checksums of what its engine holds with those of the published tensors. ``sampled``: ``verify_sample``
    tensors per update (rotating through all of them), plus a full check every ``verify_full_every`` versions;
    ``full``: every tensor of every update; ``off``: none. A mismatch is counted as ``weight_mismatch`` with the
    tensor names (worker status, ``loader.stats()``, the debugger's anomalies); the worker keeps running."""
    verify_sample: int = 4
    """``verify: sampled``: tensors checked per update."""
    verify_full_every: int = 100
    """Every this many policy versions the check covers every tensor (0: only on demand). A full check on a CPU
    vLLM engine reads each packed linear weight back through its kernel (a matrix product per tensor)."""
    shadow: bool = False
    """``shm`` with the HF engine on CPU: the engine keeps a second, private copy of its weights (the shadow,
    :mod:`asyncrl.weights.shadow`) that the receiver fills bucket by bucket while the trainer publishes, with the
    verification fused into that copy; at the safe point the engine swaps shadow and live storage (O(1) per
    tensor), so applying an update costs no copy. Off by default: it doubles each worker's parameter memory,
    which is what bounds how many workers fit beside the trainer; turn it on where the update's latency matters
    (large models, frequent updates). ``lora`` updates, and versions that do not fit the engine's dtypes and
    shapes, go the usual way."""

    def __post_init__(self):
        if type(self.delta_threads) is not int or self.delta_threads < 1:
            raise ValueError(f"weights.delta_threads={self.delta_threads!r} must be an integer >= 1 (encoder threads "
                             "of the zmq broadcaster; 1 unless the trainer has idle cores)")
        if self.shadow and self.type != "shm" and self.relay is None:
            raise ValueError(f"weights.shadow needs weights.type='shm' or a weights.relay (got {self.type!r}): only "
                             "the shared-memory receiver fills an engine's shadow weights; set weights.shadow=false")
        if self.relay is not None and self.type != "zmq":
            raise ValueError(f"weights.relay={self.relay!r} needs weights.type='zmq' (got {self.type!r}): the relay "
                             "and the direct path it falls back to are the zmq weight channel; set weights.type=zmq "
                             "and weights.address to the broadcaster's endpoint")


@dataclass(kw_only=True, slots=True)
class RelayConfig:
    """A node's weight relay (``asyncrl relay``, :mod:`asyncrl.weights.relay`): receives each version once from the
    trainer's ``zmq`` broadcaster and re-serves it to the workers on its node, whose ``weights.relay`` names its
    directory. The ``relay`` section of ``asyncrl relay --config FILE``."""

    connect: str | None = None
    """The broadcaster's endpoint (the trainer's ``weights.address``, ``weights.type: zmq``); ``--connect``."""
    directory: str | None = None
    """This node's relay directory (created 0700; under ``/dev/shm`` for ``shm``); ``--serve-shm`` /
    ``--serve-cuda-ipc``. One relay per directory: a second one is refused while the first lives."""
    serve: Literal["shm", "cuda_ipc"] = "shm"
    """How the node's workers read versions: ``shm`` (segments in ``directory``: CPU workers, or GPU workers that
    copy from host memory) or ``cuda_ipc`` (GPU slots on ``device``; the workers' engines copy GPU to GPU)."""
    device: str | None = None
    """``cuda_ipc``: the GPU that holds the slots (``cuda:N``)."""
    delta: bool = False
    """Ask the broadcaster for deltas against the version this relay served last (the trainer's ``weights.delta``
    must be on too); the node's workers read full versions from shared memory either way."""
    timeout_s: float = 30.0
    """How long the relay waits for the broadcaster at start, and a transfer for its next bucket."""
    slot_wait_s: float = 1.0
    """How long a re-serve waits for the node's workers to release the slot it reuses before writing a fresh one."""
    max_restarts: int | None = None
    """Supervised (the default of ``asyncrl relay``): how many times a relay that died is replaced; None: always."""
    backoff_s: float = 1.0
    """Supervised: the wait before replacing a relay that died, doubled for each further quick death."""

    def __post_init__(self):
        if self.timeout_s <= 0 or self.slot_wait_s < 0 or self.backoff_s < 0:
            raise ValueError(f"relay.timeout_s={self.timeout_s} must be > 0, relay.slot_wait_s={self.slot_wait_s} and "
                             f"relay.backoff_s={self.backoff_s} >= 0")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"relay.max_restarts={self.max_restarts} must be >= 0 (or null: always replace it)")
        if self.device is not None and self.serve != "cuda_ipc":
            raise ValueError(f"relay.device={self.device!r} is for relay.serve='cuda_ipc' (got {self.serve!r}); "
                             "drop the device, or serve cuda_ipc")
