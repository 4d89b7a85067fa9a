"""Post-sync verification: after a worker applies a weight update, does its engine hold what was published?

A transfer that verifies bucket by bucket can still leave the engine wrong: a fused tensor mapped in
the wrong order (q and k swapped inside vLLM's ``qkv_proj``), an adapter the engine silently did not
load, a reload that reports success and changed nothing. So after applying version ``v`` the worker
asks the engine for checksums *computed from its own parameters* (:meth:`Engine.weight_checksums
<workers.engines.base.Engine.weight_checksums>`: the HF module's tensors; vLLM's model-runner
parameters, fused ones sliced back into the trainer's names) and compares them with the checksums of
the published tensors::

    worker main thread (safe point):  names  = names_to_check(update, v)        (sampled | full)
                                      expect = checksums of update.tensors[names] (what was published:
                                                                                 every bucket was verified)
                                      engine.apply_weights(update)
                                      actual = engine.weight_checksums(update.mode, names)
                                      result = compare(expect, actual)  ──► worker status (heartbeat)
                                                                             ──► pool ──► loader.stats()
                                                                             ──► debugger: weight_mismatch

The expected checksums are those of the staged tensors, whose bytes every backend has already tied to
the broadcaster's by the bucket checksums; a backend that ships per-tensor checksums in the update's
metadata (``metadata["tensor_checksums"]``) is compared against directly. A checksum is the bucket
checksum's function (:func:`~asyncrl.weights.base.bucket_checksum`, xxh3-64: it hashes a buffer in place,
where ``google_crc32c`` takes only ``bytes``) over a tensor's bytes in C order; an engine that keeps a
tensor in another dtype reports the dtype and the expected tensor is cast to it first.

Cost: ``sampled`` (every update) checks ``sample`` tensors, rotating through all names so that every
tensor is checked every ``len(names) / sample`` versions; ``full`` checks all of them (every
``full_every`` versions, and when an update asks for it with ``metadata["verify"] == "full"`` or the
worker is asked with :meth:`WeightVerifier.request_full`). A mismatch does not stop the worker: it is a
named, counted failure (``weight_mismatch``) that the trainer sees in ``loader.stats()`` and the
debugger's anomalies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from asyncrl.weights.base import bucket_checksum

__all__ = [
    "VerifyMode",
    "VerifyResult",
    "WeightVerifier",
    "compare",
    "names_to_check",
    "tensor_checksum",
    "weight_mismatches",
]

VerifyMode = Literal["off", "sampled", "full"]
_MAX_NAMES_IN_STATUS = 200
"""Worker statuses travel in heartbeats; their strings are capped at 200 characters by the pool."""


def tensor_checksum(t: torch.Tensor) -> int:
    """:func:`~asyncrl.weights.base.bucket_checksum` of ``t``'s bytes in C order (moved to the CPU, made
    contiguous if needed; any dtype; 0-d and empty tensors included)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return bucket_checksum(memoryview(flat.numpy()))


def names_to_check(names: Sequence[str], version: int, *, mode: VerifyMode, sample: int,
                   full_every: int, force_full: bool = False) -> tuple[list[str], str]:
    """Which of an update's tensor names to verify for ``version``, and the kind of check.

    Returns:
        ``(names, kind)``: kind ``"full"`` (all), ``"sampled"`` (``sample`` names, a window that moves by
        ``sample`` per version over the sorted names, so consecutive versions check different tensors) or
        ``"off"`` (none).
    """
    ordered = sorted(names)
    if mode == "off" and not force_full:
        return [], "off"
    if mode == "full" or force_full or (full_every > 0 and version % full_every == 0) or sample >= len(ordered):
        return ordered, "full"
    start = (version * sample) % len(ordered)
    return [ordered[(start + i) % len(ordered)] for i in range(sample)], "sampled"


def compare(expected: Mapping[str, int], actual: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Names whose engine checksum differs from (or is missing against) the expected one, and names the
    engine cannot read (``None``: e.g. a tensor-parallel shard). ``actual`` maps a name to its checksum or
    to ``(dtype, checksum)``."""
    mismatched, unverifiable = [], []
    for name, want in expected.items():
        got = actual.get(name, "missing")
        if got is None:
            unverifiable.append(name)
            continue
        if isinstance(got, (tuple, list)):
            got = got[1]
        if got != want:
            mismatched.append(name)
    return mismatched, unverifiable


@dataclasses.dataclass(kw_only=True, slots=True)
class VerifyResult:
    """One verification of one applied update."""

    version: int
    kind: str
    """``full`` / ``sampled`` / ``off``."""
    checked: list[str]
    mismatched: list[str]
    unverifiable: list[str]

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def describe(self) -> str:
        if self.ok:
            return f"version {self.version}: {len(self.checked)} tensors match ({self.kind})"
        return (f"version {self.version}: {len(self.mismatched)} of {len(self.checked)} tensors differ from the "
                f"published ones ({self.kind} check): {', '.join(self.mismatched)}")


def _summary(result: VerifyResult) -> str:
    names = ", ".join(result.mismatched)
    text = f"v{result.version}: {names}"
    if len(text) > _MAX_NAMES_IN_STATUS:
        more = f" (+{len(result.mismatched)} tensors)"
        text = text[: _MAX_NAMES_IN_STATUS - len(more) - 3] + "..." + more
    return text


class WeightVerifier:
    """A worker's post-sync verification: picks names, hashes the published tensors, compares.

    Used in two calls around ``engine.apply_weights(update)``: :meth:`before` (pick the names, hash the
    published tensors, while the staged update is certainly intact) and :meth:`after` (ask the engine and
    compare). Only the worker's main thread calls it.

    Args:
        mode: ``off`` / ``sampled`` / ``full`` (``WeightSyncConfig.verify``).
        sample: tensors checked per update in ``sampled`` mode.
        full_every: a full check every this many versions (0: never, except on demand).
    """

    def __init__(self, mode: VerifyMode = "sampled", *, sample: int = 4, full_every: int = 0):
        if mode not in ("off", "sampled", "full"):
            raise ValueError(f"weights.verify={mode!r} must be 'off', 'sampled' or 'full'")
        if sample < 1 or full_every < 0:
            raise ValueError(f"weights.verify_sample={sample} must be >= 1 and weights.verify_full_every="
                             f"{full_every} >= 0")
        self.mode, self.sample, self.full_every = mode, sample, full_every
        self._force_full = False
        self.verified = 0
        """Updates checked (any kind)."""
        self.mismatches = 0
        """Updates whose engine weights differed from the published ones in at least one tensor."""
        self.mismatched_tensors = 0
        self.unverifiable = 0
        self.last: VerifyResult | None = None
        self.last_mismatch: VerifyResult | None = None

    def request_full(self) -> None:
        """The next update is verified in full (on demand)."""
        self._force_full = True

    def before(self, update: Any) -> tuple[list[str], str, dict[str, int]]:
        """Names to check for ``update``, the kind of check and the expected checksums (in the published dtype)."""
        force = self._force_full or (update.metadata or {}).get("verify") == "full"
        names, kind = names_to_check(list(update.tensors), update.version, mode=self.mode, sample=self.sample,
                                     full_every=self.full_every, force_full=force)
        shipped = (update.metadata or {}).get("tensor_checksums") or {}
        expected = {n: shipped[n] if n in shipped else tensor_checksum(update.tensors[n]) for n in names}
        return names, kind, expected

    def after(self, engine: Any, update: Any, plan: tuple[list[str], str, dict[str, int]]) -> VerifyResult | None:
        """Asks ``engine`` for the checksums of what it holds now and compares; None when nothing was checked."""
        names, kind, expected = plan
        if not names:
            return None
        self._force_full = False
        actual = engine.weight_checksums(update.mode, names)
        # an engine that keeps a tensor in another dtype reports it: the published tensor is cast to compare
        for name in names:
            got = actual.get(name)
            if isinstance(got, (tuple, list)) and got[0] != str(update.tensors[name].dtype).removeprefix("torch."):
                expected[name] = tensor_checksum(update.tensors[name].to(getattr(torch, got[0])))
        mismatched, unverifiable = compare(expected, actual)
        result = VerifyResult(version=update.version, kind=kind, checked=names, mismatched=mismatched,
                              unverifiable=unverifiable)
        self.verified += 1
        self.unverifiable += len(unverifiable)
        if mismatched:
            self.mismatches += 1
            self.mismatched_tensors += len(mismatched)
            self.last_mismatch = result
        self.last = result
        return result

    def status(self) -> dict[str, int | str]:
        """The worker-status keys (heartbeat; ints and strings of at most 200 characters)."""
        out: dict[str, int | str] = {"weights_verified": self.verified, "weight_mismatch": self.mismatches}
        if self.last_mismatch is not None:
            out["weight_mismatch_tensors"] = _summary(self.last_mismatch)
        return out



def weight_mismatches(workers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The pool's view of post-sync verification, from its workers' statuses (``transport.stats()["workers"]``):
    ``{"count": updates that mismatched, over all workers, "verified": updates checked, "workers": {worker_id:
    {"count": n, "tensors": "v7: name, ..."}}}`` (only workers with a mismatch are listed)."""
    count = verified = 0
    listed: dict[str, Any] = {}
    for worker_id, status in workers.items():
        n = status.get("weight_mismatch", 0)
        verified += int(status.get("weights_verified", 0) or 0)
        if isinstance(n, int) and n > 0:
            count += n
            listed[worker_id] = {"count": n, "tensors": status.get("weight_mismatch_tensors", "")}
    return {"count": count, "verified": verified, "workers": listed}
