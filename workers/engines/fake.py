"""A deterministic fake engine for tests and benchmarks of the data plane.

A completion depends only on ``(seed, epoch, prompt_index, sample_index, policy_version)``: the same
lease regenerated gives the same rollout, so exactly-once tests can compare content, and the same
run replays identically. Response lengths are uniform or long-tailed (lognormal); an optional
per-token delay (``engine.seconds_per_token``) stands in for decoding time.

Two modes, one time model (a sequence decodes one token every ``seconds_per_token`` of wall time):

* static, :meth:`FakeEngine.generate`: the caller blocks for the batch's longest row (every row runs at
  once; ``max_num_seqs`` does not split a static call).
* streaming (continuous batching), :meth:`FakeEngine.submit` / :meth:`FakeEngine.poll`: at most
  ``engine.max_num_seqs`` sequences decode at once (None: all), the rest wait in a FIFO queue and start the
  moment a running one finishes. Decoding advances with the wall clock, not only inside ``poll`` (like vLLM's
  engine core); ``poll`` really sleeps until the next sequence finishes or its timeout, and returns each
  request as one :class:`~workers.engines.base.Finished` once all its ``n`` samples are done. Nothing else
  blocks: ``submit`` returns at once. An update applied while sequences run (:meth:`FakeEngine.apply_weights`,
  or a pool-announced version, :meth:`FakeEngine.set_policy_version`) pauses them for ``weight_load_s``
  (the caller sleeps it) and, in ``keep`` mode (``keep_cache`` alike: it has no cache), splits their
  ``version_spans`` at the token the update found them at (later tokens are drawn for the new version); in
  ``abort`` mode every request with a started sequence comes back ``aborted`` and queued ones start under the
  new version. A sequence keeps the length it drew at its first version, so a stream without updates yields
  exactly the static rollouts.

Occupancy (:meth:`FakeEngine.occupancy`, the definition every engine shares, see
:meth:`workers.engines.base.Engine.occupancy`): ``busy_seq_s`` sums, over sequences, the seconds from the
moment each started decoding (a running slot; static: the call's start) to its own last token, less any
in-flight pause; ``capacity_seq_s`` sums W x the seconds the engine had work (static: each call; streaming:
any sequence running or queued), W = ``max_num_seqs`` when set (a static call with more rows: its rows),
otherwise the rows of the static call / the most sequences run at once so far when streaming.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncrl.config import FakeEngineConfig
from asyncrl.rollout import spans_of
from workers.engines.base import Completion, Engine, Finished, GenerationRequest, prompt_token_ids

__all__ = ["FakeEngine"]


@dataclass(slots=True)
class _Seq:
    """One sample decoding (or queued) in the streaming batch."""

    key: int
    sample: int
    length: int
    versions: list[tuple[int, int]]
    """``(version, first token index)`` of each stretch generated under one version, in order."""
    started: float = math.nan
    mark: float = math.nan
    """Wall time at which ``done`` tokens were decoded (decoding goes on from there)."""
    done: float = 0.0
    paused: float = 0.0

    def finish_time(self, spt: float) -> float:
        return self.mark + (self.length - self.done) * spt


@dataclass(slots=True)
class _Req:
    request: GenerationRequest
    prompt_ids: torch.Tensor
    completions: list[Completion | None] = field(default_factory=list)
    left: int = 0


class FakeEngine(Engine):
    follows_pool_version = True
    streaming = True

    def __init__(self, config: FakeEngineConfig):
        self.config = config
        self.policy_version = 0
        self._reqs: dict[int, _Req] = {}
        self._queue: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._ready: list[Finished] = []
        self._busy = 0.0
        self._capacity = 0.0
        self._work_since: float | None = None
        self._peak = 0

    # -- sampling -------------------------------------------------------------------------------------------

    def _length(self, rng: np.random.Generator) -> int:
        c = self.config
        if c.length_tail > 0:
            median = c.length_median or max(c.min_new_tokens, 1) * 2
            return int(np.clip(rng.lognormal(np.log(median), c.length_tail), c.min_new_tokens, c.max_new_tokens))
        return int(rng.integers(c.min_new_tokens, c.max_new_tokens + 1))

    def _rng(self, req: GenerationRequest, sample: int, version: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, req.epoch, req.prompt_index, sample, version])

    def _complete(self, req: GenerationRequest, sample: int, prompt_ids: torch.Tensor) -> Completion:
        c = self.config
        rng = self._rng(req, sample, self.policy_version)
        length = self._length(rng)
        tokens = rng.integers(0, c.vocab_size, size=length, dtype=np.int32)
        logprobs = -rng.exponential(1.0, size=length).astype(np.float32)
        return Completion(
            prompt_ids=prompt_ids,
            response_ids=torch.from_numpy(tokens),
            logprobs=torch.from_numpy(logprobs),
            finish_reason="length" if length == c.max_new_tokens else "stop",
            policy_version=self.policy_version,
        )

    def _streamed(self, r: _Req, seq: _Seq) -> Completion:
        """The completion of a sequence whose stretches span versions: the first version's draw (as
        :meth:`_complete`), later stretches drawn for their own version from their first token on."""
        c, req = self.config, r.request
        rng = self._rng(req, seq.sample, seq.versions[0][0])
        self._length(rng)
        tokens = rng.integers(0, c.vocab_size, size=seq.length, dtype=np.int32)
        logprobs = -rng.exponential(1.0, size=seq.length).astype(np.float32)
        per_token = [seq.versions[0][0]] * seq.length
        bounds = [start for _, start in seq.versions[1:]] + [seq.length]
        for (version, start), end in zip(seq.versions[1:], bounds[1:]):
            if end <= start:
                continue
            later = np.random.default_rng([c.seed, req.epoch, req.prompt_index, seq.sample, version, start])
            tokens[start:end] = later.integers(0, c.vocab_size, size=end - start, dtype=np.int32)
            logprobs[start:end] = -later.exponential(1.0, size=end - start).astype(np.float32)
            per_token[start:end] = [version] * (end - start)
        spans = spans_of(per_token)
        return Completion(
            prompt_ids=r.prompt_ids,
            response_ids=torch.from_numpy(tokens),
            logprobs=torch.from_numpy(logprobs),
            finish_reason="length" if seq.length == c.max_new_tokens else "stop",
            policy_version=min(per_token) if per_token else seq.versions[0][0],
            version_spans=spans if len(spans) > 1 else [],
        )

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Any) -> str:
        return bytes(int(i) % 256 for i in ids).decode(errors="replace")

    # -- weights --------------------------------------------------------------------------------------------

    def apply_weights(self, update: Any) -> None:
        """Adopts the update's version (the fake engine has no weights); from now on it follows the
        broadcaster instead of the version the pool announces. Sequences in flight pause for
        ``weight_load_s`` (slept here) and continue (keep) or come back aborted (abort) from :meth:`poll`."""
        self.follows_pool_version = False
        self._switch(update.version, self.config.weight_load_s)

    def set_policy_version(self, version: int) -> None:
        self._switch(version, 0.0)

    def _switch(self, version: int, load_s: float) -> None:
        now = time.perf_counter()
        self._advance(now)
        spt = self.config.seconds_per_token
        if self._running and self.weights_in_flight == "abort":
            self._abort_started(now)
        for seq in self._running:
            seq.done = min(seq.length, seq.done + (max(now - seq.mark, 0.0) / spt if spt > 0 else seq.length))
            seq.mark = now + load_s
            seq.paused += load_s
            at = int(seq.done)
            if at == 0:  # no token yet: as if it had started under the new version
                seq.versions = [(version, 0)]
                seq.length = self._draw_length(seq.key, seq.sample, version)
            elif seq.versions[-1][1] == at:
                seq.versions[-1] = (version, at)
            else:
                seq.versions.append((version, at))
        for seq in self._queue:  # not started: generated wholly under the new version
            seq.versions = [(version, 0)]
            seq.length = self._draw_length(seq.key, seq.sample, version)
        if load_s > 0:
            time.sleep(load_s)
        self.policy_version = version

    def _abort_started(self, now: float) -> None:
        """Abort mode: every request with a sequence that decoded (or finished) under the old weights."""
        keys = {s.key for s in self._running}
        keys |= {k for k, r in self._reqs.items() if any(c is not None for c in r.completions)}
        for seq in self._running:
            if seq.key in keys:
                self._busy += now - seq.started - seq.paused
        self._running = [s for s in self._running if s.key not in keys]
        self._queue = collections.deque(s for s in self._queue if s.key not in keys)
        for key in sorted(keys):
            del self._reqs[key]
            self._ready.append(Finished(key=key, aborted=True))
        self._admit(now)
        self._idle_check(now)

    # -- static ---------------------------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        t0 = time.perf_counter()
        out = []
        for req in requests:
            prompt_ids = prompt_token_ids(req.prompt)
            out.append([self._complete(req, s, prompt_ids) for s in range(req.n)])
        spt = self.config.seconds_per_token
        if spt > 0:
            longest = max((c.response_ids.numel() for group in out for c in group), default=0)
            time.sleep(longest * spt)
            call_s = time.perf_counter() - t0
            rows = sum(len(group) for group in out)
            self._busy += sum(min(c.response_ids.numel() * spt, call_s) for group in out for c in group)
            self._capacity += max(self.config.max_num_seqs or 0, rows) * call_s
        return out

    # -- streaming ------------------------------------------------------------------------------------------

    def submit(self, key: int, request: GenerationRequest) -> None:
        if key in self._reqs:
            raise ValueError(f"request key {key} is already in flight")
        now = time.perf_counter()
        self._advance(now)
        try:
            prompt_ids = prompt_token_ids(request.prompt)
        except Exception as e:  # a bad prompt fails its own request only, reported by poll
            self._ready.append(Finished(key=key, error=e))
            return
        self._reqs[key] = _Req(request, prompt_ids, [None] * request.n, request.n)
        for sample in range(request.n):
            self._queue.append(_Seq(key, sample, self._draw_length(key, sample, self.policy_version),
                                    [(self.policy_version, 0)]))
        if request.n == 0:
            self._ready.append(Finished(key=key, completions=[]))
            del self._reqs[key]
        if self._work_since is None and self._queue:
            self._work_since = now
        self._admit(now)

    def poll(self, timeout: float) -> list[Finished]:
        deadline = time.perf_counter() + max(timeout, 0.0)
        while True:
            now = time.perf_counter()
            self._advance(now)
            if self._ready or not self._running:
                out, self._ready = self._ready, []
                return out
            spt = self.config.seconds_per_token
            wake = min(min(s.finish_time(spt) for s in self._running), deadline)
            if now >= deadline:
                return []
            time.sleep(max(wake - now, 0.0))

    def in_flight(self) -> int:
        return len(self._reqs) + len(self._ready)

    def occupancy(self) -> dict[str, float]:
        now = time.perf_counter()
        self._advance(now)
        busy = self._busy + sum(now - s.started - s.paused + max(s.mark - now, 0.0) for s in self._running)
        capacity = self._capacity
        if self._work_since is not None:
            capacity += self._width() * (now - self._work_since)
        if capacity <= 0:
            return {}
        return {"busy_seq_s": busy, "capacity_seq_s": capacity}

    def _draw_length(self, key: int, sample: int, version: int) -> int:
        request = self._reqs[key].request
        length = self._length(self._rng(request, sample, version))
        return length if request.max_new_tokens is None else min(length, request.max_new_tokens)

    def _width(self) -> int:
        return self.config.max_num_seqs or self._peak

    def _admit(self, now: float) -> None:
        limit = self.config.max_num_seqs or math.inf
        while self._queue and len(self._running) < limit:
            seq = self._queue.popleft()
            seq.started = seq.mark = now
            self._running.append(seq)
        self._peak = max(self._peak, len(self._running))

    def _advance(self, now: float) -> None:
        """Plays the batch forward to ``now``: sequences finish in order of their last token, each freeing its
        slot for the next queued one at that moment."""
        spt = self.config.seconds_per_token
        while self._running:
            seq = min(self._running, key=lambda s: s.finish_time(spt))
            end = seq.finish_time(spt)
            if end > now:
                return
            self._running.remove(seq)
            self._busy += end - seq.started - seq.paused
            r = self._reqs[seq.key]
            r.completions[seq.sample] = self._streamed(r, seq)
            r.left -= 1
            if r.left == 0:
                del self._reqs[seq.key]
                self._ready.append(Finished(key=seq.key, completions=list(r.completions)))  # type: ignore[arg-type]
            self._admit(end)
            self._idle_check(end)

    def _idle_check(self, now: float) -> None:
        if not self._running and not self._queue and self._work_since is not None:
            self._capacity += self._width() * (now - self._work_since)
            self._work_since = None
