"""Streaming for the vLLM engine: vLLM v1's continuous batching request by request, weights updated in flight.

This is the vLLM implementation of partial rollouts: a weight update does not end a request and nothing is
submitted again; the request goes on under the new weights (``keep``), and its tokens carry the version of the
weights that produced each of them (vLLM's ``weight_versions`` spans, read into ``Completion.version_spans``).
:mod:`workers.partial` (prompt + tokens re-submitted per chunk) is for engines that cannot do this.

One thread of the engine's own drives vLLM's ``LLMEngine`` (the one inside the worker's ``vllm.LLM``, engine core in
this process)::

    worker thread                                      engine thread (owns every call into vLLM while it runs)
    submit(key, request) ──commands──► add_request per group (n samples) or per sample (engine.ignore_eos)
                                       step() ... step(): one scheduler step each (continuous batching: a
                                       request joins or leaves the batch between two steps)
    poll(timeout) ◄──finished queue──  a group whose requests all finished: its RequestOutputs
    apply_weights(update) ──command──► pause, load, label, resume (below), between two steps
        (blocks until done)

Why not ``AsyncLLM``: it always runs its engine core in another process (vLLM 0.32's ``EngineCoreClient.make_client``:
"Running EngineCore in asyncio without multiprocessing is not currently supported"), which costs ~45-50 s of
start-up against ~7 s in process for the tiny model on a loaded 2-core CPU machine (measured), and would send every
full update through the shm segment file or the safetensors-bytes fallback instead of by reference. The scheduler,
its preemption and its pause are the same code either way: ``EngineCore.pause_scheduler`` is what
``AsyncLLM.pause_generation`` calls in the engine core's process.

In-flight weight updates (``engine.weights_in_flight``, set by the worker):

* ``keep``: ``EngineCore.pause_scheduler(mode="keep", clear_cache=True)`` (what ``pause_generation(mode="keep",
  clear_cache=True)`` runs): every running request is preempted, its KV blocks freed and the prefix cache reset
  (``reset_prefix_cache(reset_running_requests=True)``); then the update is loaded and labelled, and
  ``resume_scheduler()``. vLLM's preemption is recompute-based: at its next step each request's prompt and the
  tokens it sampled so far are prefilled again, under the new weights, before it samples on. So no token after the
  update is computed on KV cache from the old weights: the tokens before the update are the old policy's
  (logprobs under the old weights), those after are the new policy's on the whole prefix re-encoded (logprobs under
  the new weights): the trainer's recomputation per span matches. The price is one prefill per request in flight.
  A LoRA update reaches a request in flight through the adapter id its ``LoRARequest`` names, whose adapter the
  update replaces in place (``add_lora(..., load_inplace=True)``); a request
  submitted before the engine had any adapter carries none and could not be moved onto it: such a request is
  aborted and comes back ``Finished(aborted=True)`` (the worker submits it again), as in ``abort``.
* ``abort``: every request in flight is aborted before the load; each group comes back from :meth:`poll` as
  ``Finished(aborted=True)`` with nothing of it kept.

Prefix cache across policy versions: never reused. Every update (in flight or not) resets it, and in ``keep`` mode
the KV of the requests in flight is dropped with it; vLLM's prefix cache can only share blocks computed under the
weights held since the last update.

The pause of each in-flight update (from the pause to the resume, load included) is kept in
:attr:`VLLMStreamer.pauses`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

__all__ = ["VLLMStreamer"]

logger = logging.getLogger("asyncrl.vllm")

IDLE_WAIT_S = 0.05
"""How long the engine thread waits for a command while nothing is in flight (it then looks at its stop flag)."""


@dataclass(slots=True)
class _Group:
    key: int
    prompt_ids: list[int]
    jobs: list[tuple[str, Any]]
    """(request id, SamplingParams): one request of ``n`` samples, or one per sample."""
    lora: Any
    """The LoRARequest it was submitted with (None: the base weights)."""
    inputs: dict[str, Any]
    """vLLM's prompt: ``{"prompt_token_ids": ...}`` and, for an image prompt, ``multi_modal_data``."""
    outputs: dict[str, Any] = field(default_factory=dict)
    """Request id -> its final RequestOutput."""


@dataclass(slots=True)
class _Done:
    key: int
    prompt_ids: list[int] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    """The group's CompletionOutputs, in sample order."""
    error: Exception | None = None
    aborted: bool = False


class VLLMStreamer:
    """The engine thread behind :class:`~workers.engines.vllm_engine.VLLMEngine`'s streaming interface.

    Args:
        llm_engine: the ``vllm.LLM``'s ``llm_engine``, its engine core in this process.
        width: the most sequences vLLM decodes at once (``engine.max_num_seqs``), for occupancy; None: the most
            seen running at once so far.
    """

    def __init__(self, llm_engine: Any, width: int | None = None):
        self._engine = llm_engine
        self._core = getattr(llm_engine.engine_core, "engine_core", None)
        if self._core is None:
            raise ValueError("streaming needs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); "
                             f"this one is a {type(llm_engine.engine_core).__name__}")
        self._scheduler = self._core.scheduler
        self._width = width
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._groups: dict[int, _Group] = {}
        """Engine thread only: groups inside vLLM, by key."""
        self._owner: dict[str, int] = {}
        """Engine thread only: request id -> group key."""
        self._count_lock = threading.Lock()
        self._in_flight = 0
        """Submitted and not yet returned by poll (any thread, under ``_count_lock``)."""
        self._acct_lock = threading.Lock()
        """Guards the occupancy sums below (written by the engine thread, read by any)."""
        self._busy = 0.0
        self._capacity = 0.0
        self._work_since: float | None = None
        self._widest = 0
        self.pauses: collections.deque[float] = collections.deque(maxlen=4096)
        """Seconds of each in-flight update's pause (pause to resume, load included), newest last."""
        self.aborted_groups = 0
        """Groups aborted by in-flight updates (returned as ``Finished(aborted=True)``)."""
        self._stop = False
        self._died: BaseException | None = None
        """What ended the engine thread, if not close()."""
        self._thread = threading.Thread(target=self._run, name="asyncrl-vllm-stream", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------------------
    def submit(self, key: int, prompt_ids: list[int], jobs: list[tuple[str, Any]], lora: Any,
               inputs: dict[str, Any] | None = None) -> None:
        """Queues one group for the engine thread; ``inputs`` (vLLM's prompt) defaults to the token ids alone."""
        if not self._thread.is_alive():
            raise RuntimeError("the vLLM engine thread has stopped") from self._died
        with self._count_lock:
            self._in_flight += 1
        inputs = inputs if inputs is not None else {"prompt_token_ids": prompt_ids}
        self._commands.put(("add", _Group(key=key, prompt_ids=prompt_ids, jobs=jobs, lora=lora, inputs=inputs)))

    def poll(self, timeout: float) -> list[_Done]:
        out = []
        try:
            out.append(self._finished.get(timeout=max(timeout, 0.0)) if timeout > 0 else self._finished.get_nowait())
            while True:
                out.append(self._finished.get_nowait())
        except queue.Empty:
            pass
        with self._count_lock:
            self._in_flight -= len(out)
        return out

    def in_flight(self) -> int:
        with self._count_lock:
            return self._in_flight

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the engine thread between two steps and returns its result (re-raises its error).

        Raises:
            RuntimeError: the engine thread has stopped (closed, or died: its error is the cause).
        """
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        self._commands.put(("call", (fn, future)))
        while True:
            try:
                return future.result(timeout=1.0)
            except FutureTimeout:  # a load or a long step; or the thread died before taking it: nobody will answer
                if not self._thread.is_alive():
                    self._reject_commands()

    def update(self, mode: str, load: Callable[[], None], lora: bool) -> None:
        """Applies a weight update with requests in flight (see the module): pauses, ``load()``s, resumes."""
        self.call(lambda: self._update(mode, load, lora))

    def occupancy(self) -> dict[str, float]:
        """Cumulative ``busy_seq_s`` / ``capacity_seq_s`` (read without waiting for the engine thread's step)."""
        with self._acct_lock:
            capacity = self._capacity
            if self._work_since is not None:
                capacity += self._width_now() * (time.perf_counter() - self._work_since)
            return {"busy_seq_s": self._busy, "capacity_seq_s": capacity} if capacity > 0 else {}

    def close(self) -> None:
        self._stop = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    # -- the engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # thread boundary: fail everything in flight and every waiting caller
            logger.exception("the vLLM engine thread died; failing %d groups in flight", len(self._groups))
            self._died = e
            for group in list(self._groups.values()):
                self._groups.pop(group.key, None)
                self._finished.put(_Done(key=group.key, error=RuntimeError(f"the vLLM engine thread died: {e!r}")))
        finally:
            self._reject_commands()

    def _reject_commands(self) -> None:
        """Commands nobody will run any more: calls fail, submitted groups come back failed."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            error = RuntimeError("the vLLM engine thread has stopped")
            if kind == "call":
                arg[1].set_exception(error)
            elif kind == "add":
                self._finished.put(_Done(key=arg.key, error=error))

    def _loop(self) -> None:
        while not self._stop:
            try:
                cmd = self._commands.get(timeout=IDLE_WAIT_S) if not self._groups else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            if cmd is not None:
                self._command(*cmd)
                continue  # every queued command before the next step
            if self._groups:
                self._step()

    def _command(self, kind: str, arg: Any) -> None:
        if kind == "add":
            self._add(arg)
        elif kind == "call":
            fn, future = arg
            try:
                future.set_result(fn())
            except BaseException as e:  # thread boundary: the caller re-raises it
                future.set_exception(e)

    def _add(self, group: _Group) -> None:
        try:
            for rid, params in group.jobs:
                self._engine.add_request(rid, group.inputs, params, lora_request=group.lora)
                self._owner[rid] = group.key
        except Exception as e:  # deliberate: a bad request fails its own lease, not the batch
            self._drop(group, abort=True)
            self._finished.put(_Done(key=group.key, error=e))
            return
        self._groups[group.key] = group
        with self._acct_lock:
            if self._work_since is None:
                self._work_since = time.perf_counter()

    def _step(self) -> None:
        before = self._engine.get_num_unfinished_requests()
        t0 = time.perf_counter()
        try:
            outputs = self._engine.step()
        except Exception as e:  # thread boundary: every group in flight fails with the engine's error
            logger.exception("vLLM step failed; failing %d groups in flight", len(self._groups))
            for group in list(self._groups.values()):
                self._drop(group, abort=True)
                self._finished.put(_Done(key=group.key, error=e))
            self._account_idle()
            return
        now = time.perf_counter()
        running = len(self._scheduler.running) + max(before - self._engine.get_num_unfinished_requests(), 0)
        with self._acct_lock:
            self._widest = max(self._widest, running)
            self._busy += running * (now - t0)
        for out in outputs:
            key = self._owner.get(out.request_id)
            if key is None or not out.finished:
                continue
            group = self._groups[key]
            group.outputs[out.request_id] = out
            if len(group.outputs) == len(group.jobs):
                self._drop(group, abort=False)
                completions = [c for rid, _ in group.jobs for c in group.outputs[rid].outputs]
                self._finished.put(_Done(key=key, prompt_ids=group.prompt_ids, outputs=completions))
        if not self._groups:
            self._account_idle()

    def _drop(self, group: _Group, abort: bool) -> None:
        self._groups.pop(group.key, None)
        ids = [rid for rid, _ in group.jobs]
        for rid in ids:
            self._owner.pop(rid, None)
        if abort:
            try:
                self._engine.abort_request([rid for rid in ids if rid not in group.outputs])
            except Exception:  # the engine's own failure is what the caller sees
                logger.exception("aborting the requests of group %d failed", group.key)

    def _account_idle(self) -> None:
        with self._acct_lock:
            if self._work_since is not None:
                self._capacity += self._width_now() * (time.perf_counter() - self._work_since)
                self._work_since = None

    def _width_now(self) -> int:
        return self._width or max(self._widest, 1)

    def _update(self, mode: str, load: Callable[[], None], lora: bool) -> None:
        if mode not in ("keep", "abort"):
            raise ValueError(f"engine.weights_in_flight={mode!r} must be 'keep' or 'abort'")
        t0 = time.perf_counter()
        doomed = list(self._groups.values()) if mode == "abort" else [g for g in self._groups.values()
                                                                      if lora and g.lora is None]
        for group in doomed:  # nothing partial is kept: the worker submits them again
            self._drop(group, abort=True)
            self._finished.put(_Done(key=group.key, aborted=True))
            self.aborted_groups += 1
        if not self._groups:
            self._account_idle()
        # keep: preempt every running request (KV freed, recomputed under the new weights on resume) and reset the
        # prefix cache; abort: nothing runs any more, the reset empties the prefix cache
        try:
            self._core.pause_scheduler(mode="keep", clear_cache=True)
            self._engine.reset_mm_cache()  # the front end's multimodal cache too, as pause_generation clears it
            load()
        finally:  # a failed pause or load (the old weights are back: _vllm_transfer) must not leave vLLM paused
            self._core.resume_scheduler()
            if self._groups or doomed:
                self.pauses.append(time.perf_counter() - t0)
