"""The rollout schema: ``Prompt -> Rollout -> Group``.

A :class:`Rollout` is one generated response with its provenance. Its ``uid`` is deterministic from
``(epoch, prompt_index, sample_index)``, so a regenerated rollout has the same uid and the pool can
deduplicate at-least-once delivery. A :class:`Group` is the ``n`` rollouts of one prompt (GRPO); it
travels, buffers and is delivered whole.

``to_wire`` / ``from_wire`` map a rollout to the msgpack-able dict the codec carries; ``from_wire``
validates everything a peer controls and raises :class:`~asyncrl.codec.DecodeError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncrl.codec import DecodeError

__all__ = ["FINISH_REASONS", "Group", "Rollout", "make_group_id", "make_uid", "spans_of"]

FINISH_REASONS = ("stop", "length", "abort", "env")
MAX_TOKENS = 1 << 22

_WIRE_KEYS = frozenset(
    {
        "uid",
        "group_id",
        "epoch",
        "prompt_index",
        "sample_index",
        "worker_id",
        "policy_version",
        "version_spans",
        "prompt_ids",
        "response_ids",
        "logprobs",
        "loss_mask",
        "reward",
        "reward_components",
        "finish_reason",
        "timings",
        "metadata",
    }
)
_OPTIONAL_WIRE_KEYS = frozenset({"incarnation", "sampling", "images"})
"""Keys a rollout may omit on the wire (older senders, text prompts): ``incarnation`` defaults to ``""``,
``sampling`` to None, ``images`` to none."""
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
"""The sampling settings a rollout reports (what the trainer's logprobs must be computed under)."""
MAX_INCARNATION_CHARS = 64


def _images(v: Any) -> list[bytes]:
    from asyncrl.data.images import MAX_IMAGES

    if not isinstance(v, list) or len(v) > MAX_IMAGES or not all(isinstance(x, bytes) for x in v):
        raise DecodeError(f"images must be a list of at most {MAX_IMAGES=} byte strings, got {v!r:.100}")
    return v


def spans_of(versions: list[int]) -> list[tuple[int, int, int]]:
    """Per-token policy versions -> ``(version, start, end)`` spans of equal versions, in order."""
    spans: list[tuple[int, int, int]] = []
    for pos, v in enumerate(versions):
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1], pos + 1)
        else:
            spans.append((v, pos, pos + 1))
    return spans


def make_group_id(epoch: int, prompt_index: int) -> str:
    """The id of the group of prompt ``prompt_index`` in ``epoch``."""
    return f"e{epoch}-p{prompt_index}"


def make_uid(epoch: int, prompt_index: int, sample_index: int) -> str:
    """The deterministic uid of one rollout: the same for a regenerated rollout."""
    return f"e{epoch}-p{prompt_index}-s{sample_index}"


@dataclass(kw_only=True, slots=True)
class Rollout:
    """One generated response and where it came from."""

    epoch: int
    """Epoch of the prompt."""
    prompt_index: int
    """Index of the prompt in the dataset."""
    sample_index: int
    """Which of the group's ``n`` samples this is, in ``[0, n)``."""
    worker_id: str
    """The worker that generated it."""
    policy_version: int
    """The oldest policy version that produced any of its tokens (staleness is measured from it)."""
    incarnation: str = ""
    """The trainer run incarnation whose weights produced it (:mod:`asyncrl.pool.timeline`); ``""`` = unknown
    (an engine that never received weights): judged by ``policy_version`` alone."""
    prompt_ids: torch.Tensor
    """int32 ``[P]`` prompt token ids."""
    response_ids: torch.Tensor
    """int32 ``[R]`` response token ids (generated and, for multi-turn, environment tokens)."""
    logprobs: torch.Tensor
    """float32 ``[R]`` rollout-side logprob of each response token (0 where ``loss_mask`` is 0)."""
    loss_mask: torch.Tensor | None = None
    """bool ``[R]``: True for tokens the policy generated, False for environment tokens. None = all True."""
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    """``(policy_version, start, end)`` over response positions, covering ``[0, R)`` in order. Empty = one
    span of ``policy_version``."""
    reward: float = 0.0
    """Scalar reward used for training."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Optional named parts of the reward."""
    finish_reason: str = "stop"
    """One of ``FINISH_REASONS``."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase (``generate``, ``reward``, ...)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form msgpack-able data."""
    sampling: dict[str, Any] | None = None
    """``{"temperature", "top_k", "top_p"}`` its engine sampled with (``logprobs`` are under them, and so must the
    trainer's be: :func:`asyncrl.train.logprobs.batch_logprobs`); None = not reported (an older sender)."""
    images: list[bytes] = field(default_factory=list)
    """The prompt's images, encoded, exactly the bytes the engine was given (:mod:`asyncrl.data.images`); their
    provenance (sha256, size) is ``metadata["images"]``. The trainer recomputes logprobs from these."""

    @property
    def uid(self) -> str:
        return make_uid(self.epoch, self.prompt_index, self.sample_index)

    @property
    def group_id(self) -> str:
        return make_group_id(self.epoch, self.prompt_index)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.numel() + self.response_ids.numel())

    @property
    def nbytes(self) -> int:
        n = self.prompt_ids.nbytes + self.response_ids.nbytes + self.logprobs.nbytes + sum(map(len, self.images))
        return n + (self.loss_mask.nbytes if self.loss_mask is not None else 0)

    def spans(self) -> list[tuple[int, int, int]]:
        """The per-token version spans, with the implicit single span made explicit."""
        return list(self.version_spans) or [(self.policy_version, 0, int(self.response_ids.numel()))]

    def to_wire(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "group_id": self.group_id,
            "epoch": self.epoch,
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "worker_id": self.worker_id,
            "policy_version": self.policy_version,
            "incarnation": self.incarnation,
            "version_spans": [list(s) for s in self.version_spans],
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "logprobs": self.logprobs,
            "loss_mask": self.loss_mask,
            "reward": float(self.reward),
            "reward_components": dict(self.reward_components),
            "finish_reason": self.finish_reason,
            "timings": dict(self.timings),
            "metadata": dict(self.metadata),
            **({"sampling": dict(self.sampling)} if self.sampling is not None else {}),
            **({"images": list(self.images)} if self.images else {}),
        }

    @classmethod
    def from_wire(cls, d: Any) -> Rollout:
        """Builds a rollout from a decoded dict, validating every field.

        Raises:
            DecodeError: with the offending field and value in the message.
        """
        if not isinstance(d, dict):
            raise DecodeError(f"rollout must be a map, got {type(d).__name__}")
        missing, extra = _WIRE_KEYS - d.keys(), d.keys() - _WIRE_KEYS - _OPTIONAL_WIRE_KEYS
        if missing or extra:
            raise DecodeError(f"rollout fields: missing {sorted(missing)}, unknown {sorted(map(str, extra))}")
        ints = {k: _int(d, k) for k in ("epoch", "prompt_index", "sample_index", "policy_version")}
        r = cls(
            **ints,
            worker_id=_str(d, "worker_id"),
            incarnation=_str(d, "incarnation") if "incarnation" in d else "",
            prompt_ids=_tensor(d, "prompt_ids", (torch.int32, torch.int64)),
            response_ids=_tensor(d, "response_ids", (torch.int32, torch.int64)),
            logprobs=_tensor(d, "logprobs", (torch.float32,)),
            loss_mask=None if d["loss_mask"] is None else _tensor(d, "loss_mask", (torch.bool,)),
            version_spans=_spans(d["version_spans"]),
            reward=_finite(d["reward"], "reward"),
            reward_components={
                _key(k): _finite(v, f"reward_components[{k!r}]") for k, v in _map(d, "reward_components").items()
            },
            finish_reason=_str(d, "finish_reason"),
            timings={_key(k): _finite(v, f"timings[{k!r}]") for k, v in _map(d, "timings").items()},
            metadata=_map(d, "metadata"),
            sampling=_sampling(d["sampling"]) if d.get("sampling") is not None else None,
            images=_images(d.get("images", [])),
        )
        uid, group_id = d["uid"], d["group_id"]
        if not isinstance(uid, str) or not isinstance(group_id, str) or uid != r.uid or group_id != r.group_id:
            raise DecodeError(f"uid {d['uid']!r}/group_id {d['group_id']!r} do not match {r.uid!r}/{r.group_id!r}")
        r.validate()
        return r

    def validate(self) -> None:
        """Checks cross-field consistency.

        Raises:
            DecodeError: if lengths, spans, masks or values disagree.
        """
        n = int(self.response_ids.numel())
        if self.logprobs.numel() != n:
            raise DecodeError(f"{self.uid}: {self.logprobs.numel()} logprobs for {n} response tokens")
        if self.loss_mask is not None and self.loss_mask.numel() != n:
            raise DecodeError(f"{self.uid}: loss_mask has {self.loss_mask.numel()} entries for {n} tokens")
        if n + self.prompt_ids.numel() > MAX_TOKENS:
            raise DecodeError(f"{self.uid}: {n + self.prompt_ids.numel()} tokens exceeds {MAX_TOKENS}")
        if n:
            lp = self.logprobs.numpy()  # numpy reductions cost a fraction of torch's per-call overhead
            if not np.isfinite(lp).all():
                where = np.flatnonzero(~np.isfinite(lp))
                raise DecodeError(f"{self.uid} (worker {self.worker_id}): non-finite rollout logprobs at response "
                                  f"positions {where[:8].tolist()}{' ...' if where.size > 8 else ''}")
            if lp.max() > 1e-4:
                raise DecodeError(f"{self.uid}: logprobs must be <= 0, max is {float(lp.max())}")
        if min(self.epoch, self.prompt_index, self.sample_index, self.policy_version) < 0:
            raise DecodeError(f"{self.uid}: epoch/prompt_index/sample_index/policy_version must be >= 0")
        if len(self.incarnation) > MAX_INCARNATION_CHARS:
            raise DecodeError(f"{self.uid}: incarnation is {len(self.incarnation)} chars, at most {MAX_INCARNATION_CHARS}")
        if self.finish_reason not in FINISH_REASONS:
            raise DecodeError(f"{self.uid}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if self.version_spans:
            pos = 0
            for v, start, end in self.version_spans:
                if start != pos or end < start:
                    raise DecodeError(f"{self.uid}: version spans {self.version_spans} do not tile [0, {n})")
                pos = end
            if pos != n:
                raise DecodeError(f"{self.uid}: version spans {self.version_spans} do not tile [0, {n})")
            oldest = min(v for v, _, _ in self.version_spans)
            if oldest != self.policy_version:
                raise DecodeError(f"{self.uid}: policy_version {self.policy_version} != oldest span version {oldest}")


def _sampling(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or set(v) != set(SAMPLING_KEYS):
        raise DecodeError(f"sampling must be a map of exactly {SAMPLING_KEYS}, got {v!r:.200}")
    t, k, p = v["temperature"], v["top_k"], v["top_p"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise DecodeError(f"sampling top_k={k!r} must be an int >= 0")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (t, p)):
        raise DecodeError(f"sampling temperature={t!r} and top_p={p!r} must be finite numbers")
    if not (t > 0 and 0 < p <= 1):
        raise DecodeError(f"sampling needs temperature={t} > 0 and 0 < top_p={p} <= 1")
    return {"temperature": float(t), "top_k": int(k), "top_p": float(p)}


@dataclass(kw_only=True, slots=True)
class Group:
    """The ``n`` rollouts of one prompt, delivered together (never split across batches or ranks)."""

    epoch: int
    prompt_index: int
    rollouts: list[Rollout]

    @property
    def group_id(self) -> str:
        return make_group_id(self.epoch, self.prompt_index)

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the group's rollouts."""
        return min(r.policy_version for r in self.rollouts)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rollouts)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rollouts)

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "prompt_index": self.prompt_index, "rollouts": [r.to_wire() for r in self.rollouts]}

    @classmethod
    def from_wire(cls, d: Any, *, group_size: int | None = None) -> Group:
        """Builds and validates a group: ids agree, samples ``0..n-1`` each exactly once."""
        if not isinstance(d, dict) or not isinstance(d.get("rollouts"), list):
            raise DecodeError("group must be a map with a 'rollouts' list")
        epoch, index = _int(d, "epoch"), _int(d, "prompt_index")
        rollouts = [Rollout.from_wire(r) for r in d["rollouts"]]
        group = cls(epoch=epoch, prompt_index=index, rollouts=rollouts)
        group.validate(group_size)
        return group

    def validate(self, group_size: int | None = None) -> None:
        n = len(self.rollouts)
        if group_size is not None and n != group_size:
            raise DecodeError(f"group {self.group_id} has {n} rollouts, expected group_size={group_size}")
        if n == 0:
            raise DecodeError(f"group {self.group_id} is empty")
        for r in self.rollouts:
            if (r.epoch, r.prompt_index) != (self.epoch, self.prompt_index):
                raise DecodeError(f"rollout {r.uid} does not belong to group {self.group_id}")
        if sorted(r.sample_index for r in self.rollouts) != list(range(n)):
            raise DecodeError(f"group {self.group_id} sample indices {[r.sample_index for r in self.rollouts]}")


def _int(d: dict, k: str) -> int:
    v = d.get(k)
    if not isinstance(v, int) or isinstance(v, bool) or not -(2**62) < v < 2**62:
        raise DecodeError(f"field {k!r} must be an int, got {v!r:.80}")
    return v


def _str(d: dict, k: str) -> str:
    v = d.get(k)
    if not isinstance(v, str) or len(v) > 256:
        raise DecodeError(f"field {k!r} must be a string of at most 256 chars, got {type(v).__name__}")
    return v


def _key(k: Any) -> str:
    if not isinstance(k, str):
        raise DecodeError(f"map keys must be strings, got {type(k).__name__}")
    return k


def _map(d: dict, k: str) -> dict:
    v = d.get(k)
    if not isinstance(v, dict):
        raise DecodeError(f"field {k!r} must be a map, got {type(v).__name__}")
    return v


def _finite(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise DecodeError(f"{what} must be a finite number, got {v!r:.80}")
    return float(v)


def _tensor(d: dict, k: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    v = d.get(k)
    if not isinstance(v, torch.Tensor):
        raise DecodeError(f"field {k!r} must be a tensor, got {type(v).__name__}")
    if v.dtype not in dtypes or v.dim() != 1:
        raise DecodeError(f"field {k!r} must be 1-d {dtypes}, got {v.dtype} with shape {tuple(v.shape)}")
    return v


def _spans(v: Any) -> list[tuple[int, int, int]]:
    if not isinstance(v, list) or len(v) > 4096:
        raise DecodeError("version_spans must be a list of at most 4096 spans")
    out = []
    for s in v:
        if not (isinstance(s, list) and len(s) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)):
            raise DecodeError(f"version span must be [version, start, end] ints, got {s!r:.80}")
        out.append((s[0], s[1], s[2]))
    return out
