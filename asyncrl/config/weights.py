"""The ``weights`` section: how the trainer's weights reach rollout workers (``asyncrl.weights``).

Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["WeightSyncConfig"]


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
        if self.shadow and self.type != "shm":
            raise ValueError(f"weights.shadow needs weights.type='shm' (got {self.type!r}): only the shared-memory "
                             "receiver fills an engine's shadow weights; set weights.shadow=false")
