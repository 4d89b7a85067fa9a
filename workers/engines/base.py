"""The engine interface: the generation backend inside a rollout worker.

An engine turns leased prompts into ``n`` completions each, with the logprob of every sampled
token and the policy version(s) that produced them. Engines are synchronous: the worker's main
thread blocks in :meth:`Engine.generate` while its I/O thread keeps heartbeats going.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.data.prompts import render_prompt

__all__ = ["Completion", "Engine", "Finished", "GenerationRequest", "prompt_token_ids"]


@dataclass(kw_only=True, slots=True)
class GenerationRequest:
    """One leased prompt to complete ``n`` times."""

    epoch: int
    prompt_index: int
    prompt: Any
    """The dataset item as sent by the pool (``{"prompt_ids": [...], ...}``, or ``{"text": ...}``/``{"messages": ...}``
    rendered by :func:`prompt_token_ids`)."""
    n: int
    max_new_tokens: int | None = None
    """Overrides ``engine.max_new_tokens`` (the worker generates in chunks when it may interrupt)."""


@dataclass(kw_only=True, slots=True)
class Completion:
    """One sampled response."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: str
    policy_version: int
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    loss_mask: torch.Tensor | None = None
    text: str | None = None
    """The decoded response (engines with a tokenizer), for reward functions and environments."""
    env_reward: float | None = None
    """Multi-turn episodes: the summed environment reward (used instead of the reward function)."""
    env_info: dict[str, float] = field(default_factory=dict)
    """Multi-turn episodes: the last step's ``info`` (logged as reward components)."""


@dataclass(kw_only=True, slots=True)
class Finished:
    """A streamed request that left the engine (:meth:`Engine.poll`): done, failed or aborted."""

    key: int
    """The key it was submitted with (the worker uses the lease id)."""
    completions: list[Completion] = field(default_factory=list)
    """All ``n`` completions when it finished; empty when it failed or was aborted."""
    error: Exception | None = None
    """Why it failed (the worker reports the lease FAILED with this text)."""
    aborted: bool = False
    """Aborted by an in-flight weight update in ``abort`` mode: nothing of it is kept, the worker submits it again."""


def prompt_token_ids(prompt: Any, tokenizer: Any | None = None) -> torch.Tensor:
    """int32 token ids of a prompt item: ``{"prompt_ids": [...]}`` as given (what the trainer's ``data:``
    section sends: rendered once, :mod:`asyncrl.data.prompts`); otherwise ``{"messages": [...]}``, ``{"prompt": ...}``,
    ``{"text": ...}`` or a str rendered by :func:`asyncrl.data.render_prompt`, the one rendering function (chat
    turns with the tokenizer's chat template; text after the tokenizer's bos, or as UTF-8 bytes when there is
    no tokenizer: the fake engine).

    Raises:
        ValueError: for an item with none of these.
    """
    if isinstance(prompt, dict) and "prompt_ids" in prompt:
        ids = prompt["prompt_ids"]
        return ids.to(torch.int32) if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int32)
    if isinstance(prompt, dict):
        key = next((k for k in ("messages", "prompt", "text") if k in prompt), None)
        if key is None:
            raise ValueError(f"an engine needs a prompt with 'prompt_ids', 'messages', 'prompt' or 'text', "
                             f"got {prompt!r:.200}")
        prompt = prompt[key]
    return torch.tensor(render_prompt(prompt, tokenizer), dtype=torch.int32)


class Engine(abc.ABC):
    """A generation backend."""

    follows_pool_version: bool = False
    """True for engines without real weights (the fake engine): they adopt the trainer's policy version
    announced by the pool instead of receiving weights."""

    policy_version: int = 0
    incarnation: str = ""
    """The trainer incarnation whose weights the engine holds (set by the worker when it applies an update,
    or from the pool's leases for engines that follow the pool's version); stamped on every rollout."""

    streaming: bool = False
    """True for engines that implement the streaming interface below (continuous batching: ``submit`` / ``poll``)."""

    weights_in_flight: str = "keep"
    """What :meth:`apply_weights` does to requests in flight (``worker.weights_in_flight``, set by the worker before
    its first ``submit``): ``keep`` (they continue under the new weights) or ``abort`` (they come back from
    :meth:`poll` as ``Finished(aborted=True)``)."""

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Completes each request ``request.n`` times; returns one list per request."""

    # -- streaming (continuous batching); engines with ``streaming = True`` implement these ------------------

    def submit(self, key: int, request: GenerationRequest) -> None:
        """Admits one request (``request.n`` samples) into the running batch; returns at once. Its completions
        come back from :meth:`poll` as one :class:`Finished` when all ``n`` samples are done."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def poll(self, timeout: float) -> list[Finished]:
        """Advances generation for up to ``timeout`` seconds (engines without their own scheduler thread decode in
        this call) and returns every request that finished, failed or was aborted meanwhile; returns early once
        at least one has. ``[]`` when nothing finished (or nothing is in flight)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def in_flight(self) -> int:
        """Requests submitted and not yet returned by :meth:`poll`."""
        return 0

    def occupancy(self) -> dict[str, float]:
        """Cumulative ``{"busy_seq_s": ..., "capacity_seq_s": ...}`` since the engine was built; their ratio is the
        engine occupancy the benchmarks report (busy slot-time over available slot-time), one definition for
        every engine, static and streaming. A sequence is one sample.

        * ``busy_seq_s``: over sequences, the seconds from the moment each started decoding (streaming: got a
          running slot, not while queued; static: the ``generate`` call's start) to its own last token, less any
          in-flight weight-update pause; an aborted or failed sequence counts the time it decoded.
        * ``capacity_seq_s``: W x the seconds the engine had work (static: each ``generate`` call; streaming: any
          sequence running or queued, a finished one not yet polled does not count), W = ``engine.max_num_seqs``
          when set (a static call with more rows: its rows), otherwise the rows of the static call, or the most
          sequences run at once so far when streaming.

        ``{}`` when the engine does not measure it."""
        return {}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (environments' observations)."""
        raise NotImplementedError(f"{type(self).__name__} has no tokenizer")

    def decode(self, ids: Any) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no tokenizer")

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version

    def apply_weights(self, update: Any) -> None:
        """Loads a committed :class:`~asyncrl.weights.WeightUpdate` (full or LoRA); completions generated
        afterwards carry ``update.version``. Called by the worker between generation batches; for a streaming
        engine also while requests are in flight (an in-flight update): in ``keep`` mode their later tokens are
        generated with the new weights and carry its version in ``Completion.version_spans``, in ``abort`` mode
        they come back from :meth:`poll` as ``Finished(aborted=True)``.

        Raises:
            NotImplementedError: for engines without weights.
        """
        raise NotImplementedError(f"{type(self).__name__} has no weights to update")

    def weight_checksums(self, mode: str, names: list[str]) -> dict[str, tuple[str, int] | None]:
        """Post-sync verification (:mod:`asyncrl.weights.verify`): ``(dtype, checksum)`` of what the engine holds
        now under each of the trainer's tensor ``names`` of ``mode`` (``full``: HF state dict names; ``lora``:
        peft adapter names), computed from the engine's own parameters with
        :func:`~asyncrl.weights.verify.tensor_checksum`. A name the engine does not hold is left out (a
        mismatch); one it cannot read maps to None (counted as unverifiable).

        Raises:
            NotImplementedError: for engines without weights (the worker then skips verification).
        """
        raise NotImplementedError(f"{type(self).__name__} has no weights to verify")

    def shadow_weights(self) -> Any:
        """The engine's :class:`~asyncrl.weights.shadow.ShadowWeights` (``weights.shadow``): a private second copy of
        its weights that the receiver fills during a transfer and :meth:`apply_weights` swaps in.

        Raises:
            ValueError: the engine does not hold its weights as CPU tensors it can swap (only the HF engine on the
                CPU does).
        """
        raise ValueError(f"weights.shadow: the {type(self).__name__} has no CPU tensors to shadow (the HF engine on "
                         "the CPU has); set weights.shadow=false")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases engine resources."""
