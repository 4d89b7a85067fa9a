"""Shadow weights: an engine-owned second copy of its parameters that the receiver fills while the trainer publishes.

Without a shadow, an engine with private weights loads a version only after the whole version is verified
(two-phase rule), so end to end is the broadcaster's write *then* the engine's copy. With one, the receiver's
I/O thread copies each bucket into the shadow as soon as the broadcaster publishes that bucket's checksum,
fused with the verification (one read of the shared slot, hashed while hot), in parallel with the
broadcaster writing the next bucket; at the safe point the engine swaps shadow and live storage, O(1) per
tensor (``tensor.data`` exchange: the module keeps its ``Parameter`` objects, hooks and ties)::

    receiver I/O thread:  acquire()  FREE -> FILLING     (busy: this version is staged as views, as without a shadow)
                          bucket i's bytes final (the header's progress, per MiB) -> BucketScatter.advance
                                (slot bytes -> shadow tensors, xxh3 fused); bucket i published -> compare checksums
                          all buckets verified -> finish()  FILLING -> HELD    -> staged WeightUpdate over the shadow
                          any failure, a newer version, close -> abort()  FILLING -> FREE   (nothing staged)
    worker main thread:   engine.apply_weights(update) -> swap_into(live, update)   (HELD: live <-> shadow)
                          receiver.commit(v) -> the update is unused -> release()   HELD -> FREE
                                                (the shadow now is the previous live storage: the next fill's target)

Nothing is visible to generation until the swap, which runs where the copy ran (the worker's safe point,
before ``commit``), so version fencing and the two-phase rule are unchanged: a version that fails
verification is never swapped in, and the shadow is simply refilled by the next one. The shadow is written
only while FILLING, never while HELD, so an update handed to the engine (or refused by it) keeps its bytes
until the staging area releases it. The receiver does not hold the shared slot once the shadow is full.

Ties: names whose live tensors share storage (an embedding tied to the output head) share one shadow tensor,
and every live tensor of such a group gets the same new storage at the swap, so ties survive. Views into
one storage at different offsets (a fused weight with split views) are refused: a swap would separate them.

What the engine must not do: keep an alias of a parameter's storage across updates (``w = param.data`` cached
for later forwards). After a swap that storage is the shadow, which the next transfer overwrites while the engine
generates; modules that read ``self.weight`` at each forward (every HF model) always see the live storage.

Who blocks on what: nothing blocks; every method takes one lock briefly. Costs one extra copy of the
parameters per engine (``weights.shadow``, off by default).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from asyncrl.weights.base import TensorSlot

__all__ = ["ShadowWeights"]

FREE, FILLING, HELD = "free", "filling", "held"


def _spec(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape)


class ShadowWeights:
    """A private copy of an engine's tensors, filled by a receiver, swapped into the engine at commit.

    Args:
        live: the engine's tensors by published name (HF: ``model.state_dict(keep_vars=True)``: the module's own
            ``Parameter`` and buffer objects, tied names sharing one). CPU, contiguous.
        prefault: touch the shadow's pages now, so the first version pays no page faults.

    Raises:
        ValueError: a tensor not on the CPU or not contiguous, or tensors that are different views of one storage.
    """

    def __init__(self, live: Mapping[str, torch.Tensor], *, prefault: bool = True):
        self._group_of: dict[str, int] = {}
        self._groups: list[list[str]] = []
        self._specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        keys: dict[tuple, int] = {}
        storages: dict[int, str] = {}
        for name, t in live.items():
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"shadow weights need contiguous CPU tensors; {name} is {t.dtype}{list(t.shape)} on "
                                 f"{t.device}, contiguous={t.is_contiguous()}")
            self._specs[name] = _spec(t)
            if t.numel() == 0:
                key: tuple = ("empty", name)
            else:
                ptr = t.untyped_storage().data_ptr()
                key = (ptr, t.storage_offset(), tuple(t.shape), t.dtype)
                other = storages.setdefault(ptr, name)
                if other != name and keys.get(key) is None:
                    raise ValueError(f"shadow weights: {name} and {other} are different views of one storage; a swap "
                                     "would separate them (run without weights.shadow)")
            if key not in keys:
                keys[key] = len(self._groups)
                self._groups.append([])
            self._group_of[name] = keys[key]
            self._groups[keys[key]].append(name)
        self._tensors: list[torch.Tensor] = []
        for names in self._groups:
            t = torch.empty(self._specs[names[0]][1], dtype=live[names[0]].dtype)
            if prefault:
                t.zero_()
            self._tensors.append(t)
        self._lock = threading.Lock()
        self._state = FREE
        self._fill = 0
        self._swapped = False
        self._counters = {"fills": 0, "swaps": 0, "aborted": 0, "busy": 0}

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    @property
    def nbytes(self) -> int:
        """The memory the shadow costs (tied tensors once)."""
        return sum(t.nbytes for t in self._tensors)

    # -- receiver I/O thread ---------------------------------------------------------------------------------------
    def layout_mismatch(self, slots: Iterable[TensorSlot]) -> str | None:
        """Why a version with these tensors cannot go through the shadow (names, dtypes, shapes), or None."""
        got = {s.name: (s.dtype, tuple(s.shape)) for s in slots}
        if got.keys() != self._specs.keys():
            missing, extra = sorted(self._specs.keys() - got.keys()), sorted(got.keys() - self._specs.keys())
            return f"names differ from the engine's: missing {missing[:4]}, unexpected {extra[:4]}"
        for name, spec in got.items():
            if spec != self._specs[name]:
                return f"{name} is {spec[0]}{list(spec[1])}, the engine holds {self._specs[name][0]}{list(self._specs[name][1])}"
        return None

    def acquire(self) -> dict[str, torch.Tensor] | None:
        """FREE -> FILLING: the shadow tensor of every name (tied names share one); None while it is busy."""
        with self._lock:
            if self._state != FREE:
                self._counters["busy"] += 1
                return None
            self._state, self._fill, self._swapped = FILLING, self._fill + 1, False
            return {name: self._tensors[g] for name, g in self._group_of.items()}

    def abort(self) -> None:
        """FILLING -> FREE: the fill failed or was abandoned; its bytes are never staged."""
        with self._lock:
            if self._state == FILLING:
                self._state = FREE
                self._counters["aborted"] += 1

    def finish(self) -> tuple[int, Callable[[], None]]:
        """FILLING -> HELD: every bucket verified. Returns the fill's id (for the update's metadata) and the callback
        that frees the shadow once the staged update is unused (the staging area's release)."""
        with self._lock:
            if self._state != FILLING:
                raise RuntimeError(f"shadow weights: finish() while {self._state}")
            self._state = HELD
            self._counters["fills"] += 1
            fill = self._fill
        return fill, lambda: self._release(fill)

    def _release(self, fill: int) -> None:
        with self._lock:
            if self._state == HELD and self._fill == fill:
                self._state = FREE

    # -- engine (worker main thread) ----------------------------------------------------------------------------
    def holds(self, update: Any) -> bool:
        """Whether ``update``'s tensors are this shadow's current, verified fill."""
        meta = getattr(update, "metadata", None) or {}
        with self._lock:
            return meta.get("shadow") is self and meta.get("shadow_fill") == self._fill and self._state == HELD

    def swap_into(self, live: Mapping[str, torch.Tensor], update: Any) -> bool:
        """Makes ``live`` (the engine's tensors, as given to the constructor) hold ``update``'s version: each live
        tensor takes the shadow's storage and the shadow keeps the old one. All checks run before anything changes.

        Returns:
            True; False if this fill was already swapped in (a re-apply of the same update: nothing to do).

        Raises:
            ValueError: ``update`` is not this shadow's current fill (released, or refilled since), or ``live`` no
                longer has the layout, contiguity or ties the shadow was made for.
        """
        meta = getattr(update, "metadata", None) or {}
        with self._lock:
            if not (meta.get("shadow") is self and meta.get("shadow_fill") == self._fill and self._state == HELD):
                raise ValueError(f"version {getattr(update, 'version', '?')}: its shadow fill {meta.get('shadow_fill')} "
                                 f"is not the shadow's current one ({self._fill}, {self._state}): the update was "
                                 "released (a later one was handed out, or it was committed) before it was applied")
            if self._swapped:
                return False
            groups = [self._live_group(live, names) for names in self._groups]
            for g, objs in enumerate(groups):
                old = objs[0].data
                for obj in objs:
                    obj.data = self._tensors[g]
                self._tensors[g] = old
            self._swapped = True
            self._counters["swaps"] += 1
            return True

    def _live_group(self, live: Mapping[str, torch.Tensor], names: list[str]) -> list[torch.Tensor]:
        objs: list[torch.Tensor] = []
        for name in names:
            t = live.get(name)
            # contiguous too: the old live storage becomes the next fill's target, written as flat bytes (a strided
            # one would make every later fill fail, so it is refused here and the engine copies instead)
            if t is None or _spec(t) != self._specs[name] or t.device.type != "cpu" or not t.is_contiguous():
                got = "missing" if t is None else f"{_spec(t)} on {t.device}, contiguous={t.is_contiguous()}"
                raise ValueError(f"shadow weights: the engine's {name} is {got}, the shadow holds {self._specs[name]}")
            if not any(o is t for o in objs):
                objs.append(t)
        ptrs = {o.untyped_storage().data_ptr() for o in objs if o.numel()}
        if len(ptrs) > 1:
            raise ValueError(f"shadow weights: {names} were tied (one storage) and no longer are")
        return objs

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counters, "state": self._state, "bytes": self.nbytes}
