"""Continuous batching for the HF engine: an engine-side scheduler over transformers' ``DynamicCache``.

::

    submit(key, request) ──► queue of sequences (one per sample, in submission order)
    poll(timeout): repeat until a request has all n samples done, or timeout passed (at least one step):
        admit   queued sequences up to engine.max_num_seqs, once ADMIT_FRACTION of the rows are free (or the
                queue holds no more, or nothing runs): prefill the new ones as one left-padded batch, sample each
                one's first token, write their cache rows into finished rows' slots (right-aligned, in place) or,
                with too few finished rows or a wider prompt, drop the finished rows (cache.batch_select_indices)
                and append them (left-padded to one length); drop the left padding no row needs any more
        decode  one token for every running row (one forward pass of the whole batch)
        retire  finished sequences leave the batch's bookkeeping at once (a request whose n are done is ready);
                their cache rows stay until the next admission, or until a quarter of the rows are finished
    apply_weights between two polls (the worker's main thread; nothing decodes meanwhile):
        keep    the running rows' cache is recomputed under the new weights (prompt + tokens so far,
                re-prefilled), so every later token is what the new policy samples after that prefix
        keep_cache  the cache the old weights computed stays (no re-prefill: the pause is the weight load alone); later
                tokens are sampled by the new weights attending to the old weights' keys/values of the prefix,
                carry the new version, and their logprobs are that mixed forward's (what sampled them; the trainer's
                recomputation under the new weights differs by the update's effect on the prefix's cache)
        abort   requests with a sequence running or done come back as Finished(aborted=True); ones still
                wholly queued stay (they will decode wholly under the new weights)

Everything runs on the caller's thread (the worker's main thread blocks in ``poll``); there is no scheduler thread.

Why not transformers' own continuous batching (``init_continuous_batching``): its logprobs are right (the log
of the softmax of the processed scores), but on CPU its loop took ~400 ms per decode step on the tiny model where
this one takes a few, it samples from one RNG for the whole batch (a group's tokens depend on what else runs),
``n`` is per manager, not per request, and ``pause()`` keeps the KV cache computed under the old weights.

Sampling: each row's distribution is :func:`asyncrl.train.logprobs.sampling_logprobs` of its logits (temperature,
top-k, top-p: the trainer's own function), and the logprob reported is that of the sampled token under it.
Each sequence draws its uniforms from its own ``torch.Generator`` seeded from ``(seed, epoch, prompt_index,
sample, policy_version at submit)``, one per token (``UNIFORM_BLOCK`` at a time), and the whole batch samples in
one inverse-CDF pass (the first token whose cumulative probability exceeds the row's uniform: an exact draw from
the row's distribution, as ``torch.multinomial`` is, without a call per row), so a sequence's tokens do not depend
on which other rows share the batch (up to float rounding of the batched matmuls).
Rows are left-padded with an attention mask; position ids count each row's real tokens (what the trainer's
:func:`~asyncrl.train.logprobs.token_logprobs` and ``generate`` use), so a row admitted later, padded differently, sees
the same RoPE phases.

Cost model (why admissions are batched and retirement is lazy): on a CPU with a small model, or a GPU whose batch
is memory-bound, a forward pass costs about the same for 1 or 64 rows, so the scheduler's rate is rows per pass.
A prefill is a pass of its own: admitting each row the moment it frees added ~one prefill per two decode steps at
64 rows; waiting for ``ADMIT_FRACTION`` of the rows leaves ~1/16 of them idle for a few steps and saves most of
those passes. Dropping a finished row copies every layer's cache, and so does appending below the running rows;
writing the new rows into finished rows' slots copies only the new rows (``merges`` counts both paths): for 96
groups of 8 through 64 rows, 32 in flight, ~10 % fewer CPU-seconds (median of 8 alternated rounds, 1.995 -> 1.815 s).

Lengths follow the static path: ``engine.ignore_eos`` runs each sample to its
:func:`~workers.engines._rows.length_targets` target (finish ``length``; text up to the first stop token); otherwise a
stop token ends it (kept, finish ``stop``) or ``max_new_tokens`` does (finish ``length``).

Occupancy (:meth:`~workers.engines.base.Engine.occupancy`): a sequence is busy from admission to its own last
token, less in-flight weight-update pauses; capacity is W x the wall time any sequence was running or queued,
W = ``engine.max_num_seqs``, or the most rows run at once so far when unset. The rest of the capacity is split by
cause (``occupancy()`` keys): ``pause_seq_s`` (running rows held by a keep re-prefill), ``idle_queued_seq_s`` (free
rows while sequences were queued or prefilling: the cost of batching admissions) and ``idle_empty_seq_s`` (free
rows with nothing queued: the worker had submitted nothing more), so busy + pause + idle = capacity.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncrl.train.logprobs import sampling_logprobs
from workers.engines._rows import left_pad, length_targets
from workers.engines._sampling import sample
from workers.engines.base import Completion, Finished, GenerationRequest

if TYPE_CHECKING:
    from workers.engines.hf import HFEngine

__all__ = ["ADMIT_FRACTION", "UNIFORM_BLOCK", "StreamScheduler"]

ADMIT_FRACTION = 1 / 8
"""Queued sequences are admitted (one prefill pass) once this share of ``engine.max_num_seqs`` is free, or when the
queue holds fewer, or when no row is running."""
COMPACT_FRACTION = 1 / 4
"""Finished rows are dropped from the cache before a decode step once they are this share of the batch (otherwise at
the next admission)."""
UNIFORM_BLOCK = 64
"""Uniforms a sequence draws from its generator at a time (its stream does not depend on the block)."""


@dataclass(slots=True, eq=False)
class _Seq:
    """One sample of a request: queued, then a row of the running batch, then done."""

    request: _Request
    sample: int
    limit: int
    """Most new tokens."""
    target: int | None
    """``ignore_eos``: the length it runs to."""
    generator: torch.Generator
    uniforms: list[float] = field(default_factory=list)
    """This block of the sequence's uniforms; token ``t`` uses element ``t % UNIFORM_BLOCK``."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)
    """``[version, start, end]`` per weight version its tokens came from."""
    started: float | None = None
    pause_s: float = 0.0
    """In-flight weight-update pauses while it was running (not busy)."""
    finish: str | None = None

    def uniform(self) -> float:
        """The uniform in [0, 1) of the next token."""
        i = len(self.tokens) % UNIFORM_BLOCK
        if i == 0:
            g = self.generator
            self.uniforms = torch.rand(UNIFORM_BLOCK, generator=g, dtype=torch.float64, device=g.device).tolist()
        return self.uniforms[i]


@dataclass(slots=True, eq=False)
class _Request:
    key: int
    prompt_ids: torch.Tensor
    seqs: list[_Seq] = field(default_factory=list)


class StreamScheduler:
    """The running batch of one :class:`~workers.engines.hf.HFEngine` (its ``submit``/``poll``/``in_flight``)."""

    def __init__(self, engine: HFEngine):
        self.engine = engine
        self.limit = engine.config.max_num_seqs
        self.queue: deque[_Seq] = deque()
        self.requests: dict[int, _Request] = {}
        """Submitted and not yet returned by :meth:`poll`."""
        self.ready: list[Finished] = []
        """Finished, failed or aborted, for the next :meth:`poll`."""
        self.rows: list[_Seq] = []
        """The running batch, in cache row order; finished rows stay until the next compaction (``finish`` set)."""
        self.live = 0
        """Rows of ``rows`` still decoding."""
        self.cache = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=engine.device)
        self.busy_s = 0.0
        self.capacity_s = 0.0
        """Wall seconds with a sequence running or queued (times W in :meth:`occupancy`)."""
        self.widest = 0
        self._work_since: float | None = None
        self.idle_seq_s = {"queued": 0.0, "empty": 0.0}
        """Free rows (W - running) x seconds while the engine had work: ``queued`` while sequences waited in the queue
        or were being prefilled (admission batching, ``ADMIT_FRACTION``), ``empty`` with nothing queued (the worker
        submitted nothing more)."""
        self.pause_seq_s = 0.0
        """Running rows x seconds of in-flight re-prefills (keep mode): the pause, counted neither busy nor idle."""
        self._admitting = 0
        self._tick_at = 0.0
        self.merges = {"in_place": 0, "appended": 0}
        """Admissions written into finished rows' slots, and ones appended below the running rows (a cache copy)."""

    # -- requests -----------------------------------------------------------------------------------

    def submit(self, key: int, request: GenerationRequest) -> None:
        """Queues ``request.n`` sequences under ``key``.

        Raises:
            ValueError: a key already in flight, an empty or unrenderable prompt, an image prompt, ``n < 1``
                (nothing is queued).
        """
        if key in self.requests:
            raise ValueError(f"request key {key} is already in flight")
        if request.n < 1:
            raise ValueError(f"request {key}: n={request.n} must be >= 1")
        if isinstance(request.prompt, dict) and request.prompt.get("images"):
            raise ValueError(f"request {key}: the HF engine streams text prompts only; image prompts need the static "
                             "loop (worker.streaming: false)")
        e = self.engine
        prompt = e._prompt_ids(request.prompt)
        limit = request.max_new_tokens or e.config.max_new_tokens
        targets = length_targets(e.config, request, limit) if e.config.ignore_eos else [None] * request.n
        r = _Request(key=key, prompt_ids=prompt)
        for s, target in enumerate(targets):
            seed = np.random.SeedSequence([e.config.seed, request.epoch, request.prompt_index, s, e.policy_version])
            gen = torch.Generator(device=e.device).manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))
            r.seqs.append(_Seq(request=r, sample=s, limit=limit, target=target, generator=gen))
        self.requests[key] = r
        self._tick(time.perf_counter())
        self.queue.extend(r.seqs)
        self._mark_work(time.perf_counter())

    def in_flight(self) -> int:
        return len(self.requests)

    def poll(self, timeout: float) -> list[Finished]:
        deadline = time.perf_counter() + timeout
        with torch.inference_mode():  # no autograd bookkeeping per op; the cache tensors never leave the scheduler
            while (self.live or self.queue) and not self.ready:
                self._admit()
                if self.live:
                    self._decode()
                if time.perf_counter() >= deadline:
                    break
        out, self.ready = self.ready, []
        for f in out:
            self.requests.pop(f.key, None)
        return out

    def occupancy(self) -> dict[str, float]:
        self._tick(time.perf_counter())
        capacity = self.capacity_s
        if self._work_since is not None:
            capacity += time.perf_counter() - self._work_since
        width = self.limit or self.widest
        busy = self.busy_s + sum(time.perf_counter() - s.started - s.pause_s for s in self.rows if s.finish is None)
        return {"busy_seq_s": busy, "capacity_seq_s": capacity * width, "idle_queued_seq_s": self.idle_seq_s["queued"],
                "idle_empty_seq_s": self.idle_seq_s["empty"], "pause_seq_s": self.pause_seq_s}

    # -- weights --------------------------------------------------------------------------------------

    def weights_changed(self, version: int, mode: str) -> None:
        """After the engine loaded ``version``: ``keep`` re-prefills the running rows under it, ``abort`` aborts the
        requests that have a sequence running or done."""
        if mode == "abort":
            self._abort_started()
            return
        if mode not in ("keep", "keep_cache"):
            raise ValueError(f"engine.weights_in_flight={mode!r} must be 'keep', 'keep_cache' or 'abort'")
        if mode == "keep_cache":  # the old weights' cache stays: later tokens are the new weights' on it
            self._new_spans(version)
            return
        with torch.inference_mode():
            self._compact()
            if self.rows:
                self._reprefill(version)

    def _new_spans(self, version: int) -> None:
        """The running rows' next tokens are ``version``'s (their last sampled token is already the old one's)."""
        for s in self.rows:
            if s.finish is None and s.spans[-1][0] != version:  # a reload of the same version continues its span
                s.spans.append([version, len(s.tokens), len(s.tokens)])

    def _reprefill(self, version: int) -> None:
        t0 = time.perf_counter()
        self._new_spans(version)
        # The last sampled token is not in the cache yet (it is the next step's input): prefill all before it.
        seqs = [torch.cat([s.request.prompt_ids.long(), torch.tensor(s.tokens[:-1], dtype=torch.long)])
                for s in self.rows]
        try:
            self.cache, self.mask, _ = self._prefill(seqs)
        except Exception as e:  # deliberate fault tolerance: the rows cannot go on; their requests fail, others stay
            self._fail({s.request for s in self.rows}, e)
        pause = time.perf_counter() - t0
        for s in self.rows:
            s.pause_s += pause
        self.pause_seq_s += pause * sum(s.finish is None for s in self.rows)

    def _abort_started(self) -> None:
        started = {s.request for s in self.rows}
        started |= {r for r in self.requests.values() if any(s.started is not None for s in r.seqs)}
        started = {r for r in started if r.key in self.requests and not any(f.key == r.key for f in self.ready)}
        with torch.inference_mode():
            self._drop(started)
        self.ready.extend(Finished(key=r.key, aborted=True) for r in started)

    # -- scheduling -------------------------------------------------------------------------------------

    def _admit(self) -> None:
        free = len(self.queue) if self.limit is None else min(self.limit - self.live, len(self.queue))
        if free <= 0:
            return
        if self.live and self.limit is not None and free < min(max(1, int(self.limit * ADMIT_FRACTION)), len(self.queue)):
            return  # a prefill is a forward pass of its own: wait until a few rows are free (module docstring)
        self._tick(time.perf_counter())
        new = [self.queue.popleft() for _ in range(free)]
        self._admitting = len(new)  # free rows stay "queued" while these prefill
        try:
            prefilled = [(new, *self._prefill([s.request.prompt_ids.long() for s in new]))]
        except Exception:  # deliberate fault tolerance: find the request(s) at fault, prefill the others
            prefilled = []
            for r in dict.fromkeys(s.request for s in new):
                mine = [s for s in new if s.request is r]
                try:
                    prefilled.append((mine, *self._prefill([r.prompt_ids.long()] * len(mine))))
                except Exception as e:  # this request fails alone, the running batch goes on
                    self._fail({r}, e)
        for group in prefilled:
            self._start(*group)
        self._admitting = 0

    def _start(self, new: list[_Seq], cache, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """Makes prefilled ``new`` running rows and samples their first tokens."""
        now = time.perf_counter()
        self._tick(now)
        self._admitting = max(0, self._admitting - len(new))
        for s in new:
            s.started = now
            s.spans.append([self.engine.policy_version, 0, 0])
        self._merge(new, cache, mask)
        self.live += len(new)
        self.widest = max(self.widest, self.live)
        self._sample(new, logits)
        self._retire(new)

    def _decode(self) -> None:
        e = self.engine
        if len(self.rows) - self.live >= max(1, len(self.rows) * COMPACT_FRACTION):
            self._compact()
        last = torch.tensor([[s.tokens[-1]] for s in self.rows], dtype=torch.long, device=e.device)
        positions = self.mask.sum(-1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones_like(last)], dim=1)
        with torch.no_grad():
            out = e.model(input_ids=last, attention_mask=self.mask, position_ids=positions,
                          past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        logits = out.logits[:, -1]
        if self.live < len(self.rows):  # finished rows still in the cache decode along; nothing is sampled for them
            running = [i for i, s in enumerate(self.rows) if s.finish is None]
            seqs = [self.rows[i] for i in running]
            logits = logits[torch.tensor(running, device=logits.device)]
        else:
            seqs = self.rows
        self._sample(seqs, logits)
        self._retire(seqs)

    def _prefill(self, seqs: list[torch.Tensor]):
        """A fresh cache of ``seqs`` left-padded to one length, their mask and the logits after each."""
        from transformers import DynamicCache

        e = self.engine
        ids, mask = left_pad(seqs, e.pad_id)
        ids, mask = ids.to(e.device), mask.to(e.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=e.model.config)
        out = e.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                      use_cache=True, logits_to_keep=1)
        return out.past_key_values, mask, out.logits[:, -1]

    def _merge(self, new: list[_Seq], cache, mask: torch.Tensor) -> None:
        """Puts ``new``'s cache rows into the batch: into finished rows' slots when there are enough of them and the
        new rows are no wider than the batch (written in place, right-aligned: no copy of the running rows' cache),
        else below the running ones once the finished rows are dropped, left-padding the shorter side."""
        if self.rows:
            for layer in self.cache.layers:
                if getattr(layer, "is_sliding", False):
                    raise NotImplementedError("the HF streaming engine supports full-attention caches only, "
                                              f"got {type(layer).__name__}")
            slots = [i for i, s in enumerate(self.rows) if s.finish is not None][: len(new)]
            width = self.mask.shape[1]
            if len(slots) == len(new) and mask.shape[1] <= width:
                index = torch.tensor(slots, dtype=torch.long, device=self.mask.device)
                for old_layer, new_layer in zip(self.cache.layers, cache.layers):
                    for name in ("keys", "values"):
                        getattr(old_layer, name)[index] = _left_pad(getattr(new_layer, name), width, -2)
                self.mask[index] = _left_pad(mask, width, 1)
                for i, s in zip(slots, new):
                    self.rows[i] = s
                self._trim()
                self.merges["in_place"] += 1
                return
            self._compact()
        self.merges["appended"] += 1
        if not self.rows:
            self.rows, self.cache, self.mask = list(new), cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old_layer, new_layer in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = _left_pad(getattr(old_layer, name), width, -2), _left_pad(getattr(new_layer, name), width, -2)
                setattr(old_layer, name, torch.cat([a, b], dim=0))
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)], dim=0)
        self.rows.extend(new)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """One token for each of ``seqs`` (the rows of ``logits``): inverse-CDF draws with each sequence's uniform."""
        c = self.engine.config
        logp = sampling_logprobs(logits, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                                 suppress_token_ids=self.engine._suppress)
        u = torch.tensor([s.uniform() for s in seqs], dtype=torch.float64, device=logp.device)
        tokens, chosen = sample(logp, u)  # the static lean decode's sampler too (workers.engines._sampling)
        stops = self.engine.stop_ids
        for s, token, lp in zip(seqs, tokens.tolist(), chosen.tolist()):
            s.tokens.append(token)
            s.logprobs.append(lp)
            s.spans[-1][2] = len(s.tokens)
            n = len(s.tokens)
            if s.target is not None:
                s.finish = "length" if n >= s.target else None
            elif token in stops:
                s.finish = "stop"
            elif n >= s.limit:
                s.finish = "length"

    def _retire(self, sampled: list[_Seq]) -> None:
        """Counts the sequences of ``sampled`` that just finished out of the batch (their cache rows stay until the
        next compaction); a request whose last sequence finished goes to ``ready``."""
        done = [s for s in sampled if s.finish is not None]
        if not done:
            return
        now = time.perf_counter()
        self._tick(now)
        for s in done:
            self.busy_s += now - s.started - s.pause_s
        self.live -= len(done)
        if not self.live:
            self._select([])
        for r in {s.request for s in done}:
            if all(s.finish is not None for s in r.seqs):
                self.ready.append(Finished(key=r.key, completions=[self._completion(s) for s in r.seqs]))
        self._mark_work(now)

    def _compact(self) -> None:
        """Drops the finished rows' cache rows."""
        if self.live < len(self.rows):
            self._select([i for i, s in enumerate(self.rows) if s.finish is None])

    def _select(self, keep: list[int]) -> None:
        """Keeps rows ``keep`` of the batch and trims the left padding every remaining row has."""
        self.rows = [self.rows[i] for i in keep]
        self.live = sum(s.finish is None for s in self.rows)
        if not self.rows:
            self.cache, self.mask = None, self.mask[:0, :0]
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self._trim()

    def _trim(self) -> None:
        """Drops the left padding every row of the batch has (views: the next decode step's cache append copies)."""
        first = int(self.mask.any(0).nonzero()[0, 0])
        if first:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
            self.mask = self.mask[:, first:]

    def _fail(self, requests: set[_Request], error: Exception) -> None:
        self._drop(requests)
        self.ready.extend(Finished(key=r.key, error=error) for r in requests)

    def _drop(self, requests: set[_Request]) -> None:
        """Removes every sequence of ``requests`` from the batch and the queue (busy time up to now is counted)."""
        now = time.perf_counter()
        self._tick(now)
        for s in self.rows:
            if s.request in requests and s.finish is None:
                self.busy_s += now - s.started - s.pause_s
        self._select([i for i, s in enumerate(self.rows) if s.request not in requests])
        self.queue = deque(s for s in self.queue if s.request not in requests)
        self._mark_work(now)

    def _tick(self, now: float) -> None:
        """Adds the free rows since the last tick to ``idle_seq_s``; call it before ``live`` or the queue change."""
        if self._work_since is not None:
            free = (self.limit or self.widest) - self.live
            if free > 0:
                self.idle_seq_s["queued" if self.queue or self._admitting else "empty"] += free * (now - self._tick_at)
        self._tick_at = now

    def _mark_work(self, now: float) -> None:
        """Opens or closes the capacity interval as the engine gains its first or loses its last sequence."""
        self._tick(now)
        working = bool(self.live or self.queue)
        if working and self._work_since is None:
            self._work_since = now
        elif not working and self._work_since is not None:
            self.capacity_s += now - self._work_since
            self._work_since = None

    # -- results ----------------------------------------------------------------------------------------

    def _completion(self, s: _Seq) -> Completion:
        e = self.engine
        response = torch.tensor(s.tokens, dtype=torch.int32)
        text_end = len(s.tokens)
        if s.target is not None:
            text_end = next((i for i, t in enumerate(s.tokens) if t in e.stop_ids), text_end)
        spans = [tuple(span) for span in s.spans if span[2] > span[1]]
        return Completion(
            prompt_ids=s.request.prompt_ids,
            response_ids=response,
            logprobs=torch.tensor(s.logprobs, dtype=torch.float32),
            finish_reason=s.finish,
            policy_version=min(v for v, _, _ in spans),
            version_spans=spans if len({v for v, _, _ in spans}) > 1 else [],
            text=e.decode(response[:text_end]),
        )


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
