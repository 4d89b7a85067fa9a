"""A deterministic fake engine for tests and benchmarks of the data plane.

A completion depends only on ``(seed, epoch, prompt_index, sample_index, policy_version)``: the same
lease regenerated gives the same rollout, so exactly-once tests can compare content, and the same
run replays identically. Response lengths are uniform or long-tailed (lognormal); an optional
per-token delay stands in for decoding time (batched: a batch takes as long as its longest row).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from asyncrl.config import EngineConfig
from workers.engines.base import Completion, Engine, GenerationRequest, prompt_token_ids

__all__ = ["FakeEngine"]


class FakeEngine(Engine):
    follows_pool_version = True

    def __init__(self, config: EngineConfig):
        self.config = config
        self.policy_version = 0

    def _length(self, rng: np.random.Generator) -> int:
        c = self.config
        if c.length_tail > 0:
            median = c.length_median or max(c.min_new_tokens, 1) * 2
            return int(np.clip(rng.lognormal(np.log(median), c.length_tail), c.min_new_tokens, c.max_new_tokens))
        return int(rng.integers(c.min_new_tokens, c.max_new_tokens + 1))

    def _complete(self, req: GenerationRequest, sample: int, prompt_ids: torch.Tensor) -> Completion:
        c = self.config
        rng = np.random.default_rng([c.seed, req.epoch, req.prompt_index, sample, self.policy_version])
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

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Any) -> str:
        return bytes(int(i) % 256 for i in ids).decode(errors="replace")

    def apply_weights(self, update: Any) -> None:
        """Adopts the update's version (the fake engine has no weights); from now on it follows the
        broadcaster instead of the version the pool announces."""
        self.follows_pool_version = False
        if self.config.weight_load_s > 0:
            time.sleep(self.config.weight_load_s)
        self.policy_version = update.version

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        out = []
        for req in requests:
            prompt_ids = prompt_token_ids(req.prompt)
            out.append([self._complete(req, s, prompt_ids) for s in range(req.n)])
        if self.config.seconds_per_token > 0:
            longest = max((c.response_ids.numel() for group in out for c in group), default=0)
            time.sleep(longest * self.config.seconds_per_token)
        return out
