"""Partial rollouts: generation that new weights may interrupt.

With ``worker.interrupt_every_tokens = c > 0``, the worker generates in chunks of ``c`` tokens and
checks for fully staged weights between chunks; when a version arrives it is applied at once and
the remaining tokens are generated with it (the tokens generated so far are kept). Each rollout
then carries per-token ``version_spans`` such as ``[(3, 0, 16), (4, 16, 40)]`` and its
``policy_version`` is the oldest (3), so staleness stays conservative while the trainer can mask
or reweight by ``token_versions``. Continuation re-submits ``prompt + tokens so far`` as the next
chunk's prompt: vLLM's prefix cache makes that cheap, the HF engine re-encodes it.

This is the static loop's way (``worker.streaming: false``). The streaming loop (:mod:`workers.streaming`)
replaces it: a streaming engine takes the update in flight, between two polls, with no re-submission, and the
two settings are refused together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from asyncrl.rollout import spans_of
from workers.engines.base import Completion, Engine, GenerationRequest

__all__ = ["generate_interruptible"]


@dataclass(slots=True)
class _Partial:
    request: int
    prompt_ids: torch.Tensor | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None


def generate_interruptible(
    engine: Engine,
    requests: list[GenerationRequest],
    *,
    chunk_tokens: int,
    max_new_tokens: int,
    between_chunks: Callable[[], object],
) -> list[list[Completion]]:
    """Generates like ``engine.generate``, calling ``between_chunks()`` (apply staged weights) every
    ``chunk_tokens`` tokens."""
    if chunk_tokens < 1:
        raise ValueError(f"{chunk_tokens=} must be >= 1")
    parts = [_Partial(i) for i, r in enumerate(requests) for _ in range(r.n)]
    while True:
        active = [p for p in parts if p.finish_reason is None]
        if not active:
            break
        chunk = min(chunk_tokens, max_new_tokens - len(active[0].ids))
        batch = [
            GenerationRequest(
                epoch=requests[p.request].epoch,
                prompt_index=requests[p.request].prompt_index,
                prompt=requests[p.request].prompt if p.prompt_ids is None else {"prompt_ids": [*p.prompt_ids.tolist(), *p.ids]},
                n=1,
                max_new_tokens=chunk,
            )
            for p in active
        ]
        for p, (c,) in zip(active, engine.generate(batch)):
            _extend(p, c, done=len(p.ids) + int(c.response_ids.numel()) >= max_new_tokens)
        if any(p.finish_reason is None for p in parts):
            between_chunks()
    out: list[list[Completion]] = [[] for _ in requests]
    for p in parts:
        out[p.request].append(_completion(p))
    return out


def _extend(p: _Partial, c: Completion, done: bool) -> None:
    if p.prompt_ids is None:
        p.prompt_ids = c.prompt_ids
    n = int(c.response_ids.numel())
    p.ids += c.response_ids.tolist()
    p.logprobs += c.logprobs.tolist()
    for version, start, end in c.version_spans or [(c.policy_version, 0, n)]:
        p.versions += [version] * (end - start)
    p.texts.append(c.text or "")
    if c.finish_reason == "stop" or n == 0:
        p.finish_reason = "stop"
    elif done:
        p.finish_reason = c.finish_reason


def _completion(p: _Partial) -> Completion:
    spans = spans_of(p.versions)
    assert p.prompt_ids is not None
    return Completion(
        prompt_ids=p.prompt_ids,
        response_ids=torch.tensor(p.ids, dtype=torch.int32),
        logprobs=torch.tensor(p.logprobs, dtype=torch.float32),
        finish_reason=p.finish_reason or "length",
        policy_version=min(p.versions) if p.versions else 0,
        version_spans=spans if len(spans) > 1 else [],
        text="".join(p.texts),
    )
