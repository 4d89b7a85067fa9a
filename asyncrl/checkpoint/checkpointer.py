"""Checkpoint directories a kill cannot break: ``run_dir/checkpoints/step-N`` and the ``latest`` pointer.

A save (rank 0 drives the directory; every rank writes its files into the staging directory between
two barriers)::

    stage   .step-N.tmp/            fresh staging directory (a stale one of a killed save is removed)
            ... every rank writes .metadata + DCP shards, loader-rank{r}.pt, trainer-rank{r}.pt ...
    mark    .step-N.tmp/COMPLETE    after checking every rank's files are there: {step, world_size, files, time}
    rename  step-N/                 a name never used before (step-N.1, step-N.2, ... if step-N exists)
    point   latest -> step-N        temp file + os.replace
    prune   keep the newest ``keep`` complete checkpoints (by commit time) and whatever ``latest`` names

Rules that make every kill point safe: nothing that ``latest`` names is ever deleted or replaced (a
re-save of a step goes to a new name, and only then does ``latest`` move); a directory gets its
``step-*`` name only once it is complete; ``latest`` moves only to a renamed, complete directory.
A kill before ``point`` leaves ``latest`` on the previous checkpoint (the renamed one is complete but
unnamed, and pruned later). On resume :meth:`CheckpointDir.resolve` checks what ``latest`` names and,
if it is missing or incomplete (a checkpoint written by an older version, damaged by hand), falls back
to the newest complete checkpoint and says which and why.

A checkpoint is *complete* when its ``COMPLETE`` marker and every file the marker lists exist;
a directory without a marker (written before markers existed) is complete when ``.metadata`` and
every rank's loader and trainer files exist.

What a checkpoint holds (:class:`Checkpointer`, usable from any loop, one process or many)::

    .metadata + shards     model and optimizer (torch.distributed.checkpoint: sharded under FSDP2, any world)
    loader-rank{r}.pt      each rank's RolloutLoader.state_dict() (ledger, leases, buffered rollouts)
    trainer-rank{r}.pt     {"rng", "cuda_rng", "step", "policy_version", "extra"} of rank r
    config.json ...        files rank 0 adds (``files=``)
    base.json              ``base=`` only: the frozen base the adapter was trained on, by hash (asyncrl.models.qlora)

A checkpoint resumes at any number of ranks (:meth:`Checkpointer.load`): DCP reshards the model and the optimizer,
and at another number than saved it every rank reads the loader files of all saved ranks, merged and re-dealt by
``RolloutLoader.load_state_dict`` (:mod:`asyncrl.pool.reshard`).

With ``base=`` (QLoRA: a frozen 4-bit base under a trained adapter) the DCP sections hold only the trainable
parameters and their optimizer state: the base is referenced by content hash, not copied, and a resume onto
another base is refused (:class:`BaseMismatch`).

Who blocks on what: :meth:`Checkpointer.save`, :meth:`Checkpointer.resolve` and :meth:`Checkpointer.load`
are collectives when a process group is initialised (barriers; DCP's own collectives): every rank calls
them at the same step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BASE", "LATEST", "MARKER", "MODEL", "OPTIM", "SAVE_POINTS", "BaseMismatch", "CheckpointDir", "Checkpointer",
           "TrainerState", "check_base"]

LATEST = "latest"
MARKER = "COMPLETE"
SAVE_POINTS = ("staged", "marked", "renamed", "pointed", "pruned")
"""Where a save can be interrupted, in order (the ``hook`` is called *after* each)."""
_NAME = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
MODEL = "model"
"""The DCP section of the model's state dict."""
OPTIM = "optim"
"""The DCP section of the optimizer's state dict."""
BASE = "base.json"
"""The reference to the frozen base of a checkpoint saved with ``Checkpointer(base=...)``."""


class BaseMismatch(ValueError):
    """A checkpoint's frozen base is not the one this run holds (or one of them has none)."""


def check_base(checkpoint: Path, base: Mapping[str, Any] | None) -> None:
    """Raises :class:`BaseMismatch` unless ``checkpoint`` and a run holding ``base`` (None: no referenced base,
    the whole model is in the checkpoint) agree on the frozen base: the ``identity`` entries must be equal."""
    saved = json.loads((checkpoint / BASE).read_text()) if (checkpoint / BASE).exists() else None
    if saved is None and base is None:
        return
    if saved is None:
        raise BaseMismatch(f"{checkpoint} holds the whole model, not an adapter over a referenced base (it was not "
                           "saved with base=, i.e. without lora.qlora); resume it without lora.qlora, or start a "
                           "fresh QLoRA run")
    if base is None:
        raise BaseMismatch(f"{checkpoint} holds only an adapter over the base "
                           f"{saved.get('about', {}).get('model_dir')} (saved with base=, i.e. lora.qlora=true); "
                           "resume it with lora.qlora=true")
    mine, theirs = base["identity"], saved.get("identity", {})
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differ:
        raise BaseMismatch(
            f"{checkpoint} was trained on another base: {', '.join(f'{k}={theirs.get(k)!r}' for k in differ)} "
            f"(base {saved.get('about', {}).get('model_dir')}), but this run's base "
            f"{base.get('about', {}).get('model_dir')} has {', '.join(f'{k}={mine.get(k)!r}' for k in differ)}; "
            "resume on the base the adapter was trained on (the same model directory, unchanged) or start a fresh run")


def rank_files(world_size: int) -> list[str]:
    """The files every complete checkpoint of a ``world_size``-rank run holds (besides DCP's shards)."""
    return [".metadata", *(f"{kind}-rank{r}.pt" for r in range(world_size) for kind in ("loader", "trainer"))]


class CheckpointDir:
    """``run_dir/checkpoints``: saving (rank 0 only) and choosing the checkpoint to resume from (any rank).

    Args:
        root: the checkpoints directory.
        world_size: ranks of this run (whose files a complete checkpoint must hold).
        keep: complete checkpoints kept by :meth:`prune`, besides whatever ``latest`` names; 0 keeps all.
        hook: called with ``(point, step)`` after each of :data:`SAVE_POINTS` (fault injection for tests).
    """

    def __init__(self, root: str | os.PathLike, *, world_size: int, keep: int = 2,
                 hook: Callable[[str, int], None] | None = None):
        if keep < 0 or world_size < 1:
            raise ValueError(f"need {keep=} >= 0 and {world_size=} >= 1")
        self.root = Path(root)
        self.world_size = world_size
        self.keep = keep
        self.hook = hook or (lambda point, step: None)

    # -- saving (rank 0) ---------------------------------------------------------------------------------------------
    def staging(self, step: int) -> Path:
        """The staging directory of ``step``'s save (the same path on every rank)."""
        return self.root / f".step-{step:06d}.tmp"

    def stage(self, step: int) -> Path:
        """Creates a fresh, empty staging directory for ``step`` (removing a killed save's) and returns it."""
        tmp = self.staging(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.hook("staged", step)
        return tmp

    def commit(self, tmp: Path, step: int) -> Path:
        """Marks the staged checkpoint complete, gives it a fresh ``step-N`` name, moves ``latest``, prunes.

        Raises:
            RuntimeError: a rank's file is missing from the staging directory (nothing is renamed).
        """
        files = rank_files(self.world_size)
        missing = [f for f in files if not (tmp / f).exists()]
        if missing:
            raise RuntimeError(f"checkpoint of step {step} in {tmp} is missing {missing}; not committing it")
        marker = {"step": step, "world_size": self.world_size, "files": files, "time": time.time()}
        with open(tmp / MARKER, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        self.hook("marked", step)
        final = self._free_name(step)
        os.replace(tmp, final)  # onto a name that does not exist: never over a checkpoint `latest` may name
        self.hook("renamed", step)
        self.point_latest(final)
        self.hook("pointed", step)
        self.prune()
        self.hook("pruned", step)
        return final

    def _free_name(self, step: int) -> Path:
        path = self.root / f"step-{step:06d}"
        k = 0
        while path.exists():
            k += 1
            path = self.root / f"step-{step:06d}.{k}"
        return path

    def point_latest(self, checkpoint: Path) -> None:
        """Moves ``latest`` to ``checkpoint`` atomically."""
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(checkpoint.name)
        os.replace(pointer, self.root / LATEST)

    def prune(self) -> list[Path]:
        """Deletes every ``step-*`` directory but the newest ``keep`` complete ones and what ``latest`` names,
        and staging directories of killed saves (call between saves only). Returns what it deleted."""
        named = self.latest_named()
        complete = self.complete()
        keep = set(complete[-self.keep:] if self.keep else complete)
        if named is not None:
            keep.add(named)
        doomed = [p for p in self.root.glob("step-*") if p not in keep and _NAME.match(p.name)]
        doomed += list(self.root.glob(".step-*.tmp"))
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return doomed

    # -- resuming (any rank) -----------------------------------------------------------------------------------------
    def latest_named(self) -> Path | None:
        """What ``latest`` names (whether or not it exists), or None without a ``latest``."""
        try:
            name = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        return self.root / name if name else None

    def why_incomplete(self, path: Path) -> str | None:
        """None if ``path`` is a complete checkpoint, else what is wrong with it (a phrase)."""
        if not path.is_dir():
            return "it does not exist"
        try:
            files = json.loads((path / MARKER).read_text())["files"]
        except FileNotFoundError:
            files = rank_files(self.world_size)  # written before markers existed
        except (ValueError, KeyError, TypeError):
            return f"its {MARKER} marker is unreadable"
        missing = [f for f in files if not (path / f).exists()]
        return f"it lacks {', '.join(missing)}" if missing else None

    def world_size_of(self, path: Path) -> int:
        """The number of ranks that saved the checkpoint ``path`` (its marker's, or counted from its loader files)."""
        try:
            return int(json.loads((path / MARKER).read_text())["world_size"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return len(list(path.glob("loader-rank*.pt")))

    def complete(self) -> list[Path]:
        """Complete ``step-*`` checkpoints, oldest commit first."""
        found = [p for p in self.root.glob("step-*") if _NAME.match(p.name) and self.why_incomplete(p) is None]
        return sorted(found, key=self._committed_at)

    @staticmethod
    def _committed_at(path: Path) -> tuple[float, str]:
        try:
            return float(json.loads((path / MARKER).read_text())["time"]), path.name
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return path.stat().st_mtime, path.name

    def resolve(self) -> tuple[Path | None, str]:
        """The checkpoint to resume from and, if it is not what ``latest`` names, a sentence saying why.

        Returns:
            ``(path, note)``: ``latest``'s checkpoint and ``""`` when it is complete; else the newest complete
            checkpoint (or None if there is none) and the reason for the fallback.
        """
        named = self.latest_named()
        problem = "there is no latest pointer" if named is None else None
        if named is not None:
            why = self.why_incomplete(named)
            if why is None:
                return named, ""
            problem = f"latest names {named.name}, but {why}"
        candidates = self.complete()
        if not candidates:
            return None, (f"{problem} and {self.root} holds no complete checkpoint; starting fresh"
                          if named is not None or self.root.exists() and any(self.root.glob("step-*")) else "")
        return candidates[-1], f"{problem}; resuming from the newest complete checkpoint, {candidates[-1].name}"


@dataclass(kw_only=True, slots=True)
class TrainerState:
    """What :meth:`Checkpointer.load` restored besides the model, the optimizer and the loader."""

    step: int
    """The optimizer steps (accepted or rejected) taken when the checkpoint was saved."""
    policy_version: int
    """The trainer's policy version then (give it to :class:`~asyncrl.train.policy_sync.PolicySync`)."""
    path: Path
    """The checkpoint it came from."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The caller's ``extra`` of the save (plain Python values)."""


def _dist() -> tuple[Any, int, int]:
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    return (dist if on else None), (dist.get_rank() if on else 0), (dist.get_world_size() if on else 1)


class Checkpointer:
    """Atomic checkpoints of a training loop: model + optimizer (DCP), each rank's loader state, RNG, step and
    policy version, in a :class:`CheckpointDir` (staged, marked, renamed, then ``latest`` moves).

    Args:
        root: the checkpoints directory (``run_dir/checkpoints``).
        model: the trained module (plain, DDP, FSDP2, peft).
        optimizer: its optimizer.
        loader: this rank's :class:`~datapipes.loader.RolloutLoader` (may be attached later: ``.loader = ...``,
            before the first save; the recipe builds it after loading the model).
        keep: complete checkpoints kept besides whatever ``latest`` names; 0 keeps all.
        hook: called with ``(point, step)`` after each of :data:`SAVE_POINTS` on rank 0 (fault injection).
        base: the frozen base's reference, ``{"identity": {...}, "about": {...}}`` (JSON-able;
            :func:`asyncrl.models.qlora.base_reference`). Given, checkpoints hold only the trainable parameters and
            their optimizer state plus :data:`BASE`, and loading refuses a checkpoint whose ``identity`` differs.
    """

    def __init__(self, root: str | os.PathLike, model: Any, optimizer: Any, loader: Any = None, *, keep: int = 2,
                 hook: Callable[[str, int], None] | None = None, base: Mapping[str, Any] | None = None):
        self._dist, self.rank, self.world_size = _dist()
        self.dir = CheckpointDir(root, world_size=self.world_size, keep=keep, hook=hook)
        self.model, self.optimizer, self.loader = model, optimizer, loader
        if base is not None and "identity" not in base:
            raise ValueError(f"Checkpointer base= needs an 'identity' entry (asyncrl.models.qlora.base_reference), got "
                             f"keys {sorted(base)}")
        self.base = None if base is None else dict(base)
        self.saved_step: int | None = None
        """The step of the newest checkpoint on disk for this run (saved or loaded); a save of it is skipped."""

    def _barrier(self) -> None:
        if self._dist is not None:
            self._dist.barrier()

    def save(self, step: int, policy_version: int, *, extra: Mapping[str, Any] | None = None,
             files: Mapping[str, bytes] | None = None) -> Path | None:
        """Saves one complete checkpoint of ``step`` (every rank calls it). A step already on disk (the final
        save after a periodic one of the same step, a resumed run that trained nothing) is not saved again.

        Args:
            step: optimizer steps taken.
            policy_version: the trainer's policy version.
            extra: plain values saved with each rank's trainer state (returned by :meth:`load`).
            files: ``name -> bytes`` rank 0 writes into the checkpoint (e.g. the run's config).

        Returns:
            the committed checkpoint on rank 0, None on the other ranks and for a skipped save.
        """
        import torch
        import torch.distributed.checkpoint as dcp

        if self.loader is None:
            raise RuntimeError("Checkpointer.save needs the loader (Checkpointer(..., loader=) or .loader = loader)")
        if self.saved_step == step:
            return None
        tmp = self.dir.staging(step)
        if self.rank == 0:
            self.dir.stage(step)
        self._barrier()
        model_state, optim_state = self._states()
        dcp.save({MODEL: model_state, OPTIM: optim_state}, checkpoint_id=str(tmp))
        torch.save(self.loader.state_dict(), tmp / f"loader-rank{self.rank}.pt")
        trainer = {"rng": torch.get_rng_state(), "step": step, "policy_version": policy_version,
                   "extra": dict(extra or {})}
        if torch.cuda.is_available():
            trainer["cuda_rng"] = torch.cuda.get_rng_state_all()
        torch.save(trainer, tmp / f"trainer-rank{self.rank}.pt")
        self._barrier()
        final = None
        if self.rank == 0:
            for name, data in (files or {}).items():
                (tmp / name).write_bytes(data)
            if self.base is not None:
                (tmp / BASE).write_text(json.dumps(self.base, indent=1, sort_keys=True))
            final = self.dir.commit(tmp, step)  # a crash before latest moves leaves the last good one
        self._barrier()
        self.saved_step = step
        return final

    def resolve(self) -> Path | None:
        """The checkpoint to resume from, the same on every rank: ``latest`` if complete, else the newest complete
        one (rank 0 decides, says why on stderr and points ``latest`` at it); None if there is none."""
        choice: list[Any] = [None, ""]
        if self.rank == 0:
            path, note = self.dir.resolve()
            choice = [None if path is None else str(path), note]
            if note:
                print(f"resume: {note}", file=sys.stderr, flush=True)
                if path is not None:
                    self.dir.point_latest(path)
        if self._dist is not None:
            self._dist.broadcast_object_list(choice, src=0)
        return None if choice[0] is None else Path(choice[0])

    def load(self, path: str | os.PathLike, *, loader: bool = True) -> TrainerState:
        """Restores the model, the optimizer, this rank's RNG and (``loader=True``, if attached) its loader.

        A checkpoint saved at another number of ranks resumes too: DCP reshards the model and the optimizer, the
        loader states of all saved ranks are merged and what is left of the epoch re-dealt (:meth:`load_loader`),
        and a rank the saved run did not have takes the RNG state of saved rank ``rank % saved ranks`` (step,
        policy version and ``extra`` are the same on every saved rank).

        Raises:
            FileNotFoundError: ``path`` lacks a rank's trainer file (a damaged checkpoint).
        """
        import torch

        path = Path(path)
        saved_world = self.dir.world_size_of(path)
        trainer_file = path / f"trainer-rank{self.rank % max(saved_world, 1)}.pt"
        if not trainer_file.exists():
            raise FileNotFoundError(f"{path} has no {trainer_file.name} although it was saved by {saved_world} ranks: "
                                    "a damaged checkpoint; resume from another one")
        if saved_world != self.world_size and self.rank == 0:
            print(f"resume: {path.name} was saved at {saved_world} trainer ranks, this run has {self.world_size}: the "
                  "model and optimizer are resharded, the loader states of all saved ranks merged and what is left of "
                  "the epoch re-dealt", file=sys.stderr, flush=True)
        self.load_model(path)
        trainer = torch.load(trainer_file, weights_only=True)
        torch.set_rng_state(trainer["rng"])
        if "cuda_rng" in trainer and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(trainer["cuda_rng"])
        if loader and self.loader is not None:
            self.load_loader(path)
        self.saved_step = trainer["step"]  # on disk already: a save of this same step is skipped
        return TrainerState(step=trainer["step"], policy_version=trainer["policy_version"], path=path,
                            extra=trainer.get("extra", {}))

    def load_model(self, path: str | os.PathLike) -> None:
        """Restores only the model and the optimizer (DCP: resharded to this run's ranks, any world size); what
        :meth:`load` does first. ``asyncrl check``'s ``checkpoint`` stage loads a checkpoint of N ranks at M with it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        check_base(Path(path), self.base)
        model_state, optim_state = self._states()
        state = {MODEL: model_state, OPTIM: optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM],
                       options=StateDictOptions(strict=self.base is None))  # base=: the frozen keys stay as loaded

    def _states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model and optimizer state dicts DCP saves and loads: everything, or (``base=``) only the trainable
        parameters (a 4-bit layer's quantization state is no parameter: ``ignore_frozen_params`` keeps it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if self.base is None:
            return get_state_dict(self.model, self.optimizer)
        model_state, optim_state = get_state_dict(self.model, self.optimizer,
                                                  options=StateDictOptions(ignore_frozen_params=True))
        from torch.nn.parallel import DistributedDataParallel

        # DDP's wrapper is not part of the state dict's names
        inner = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        trainable = {name for name, p in inner.named_parameters() if p.requires_grad}
        return {k: v for k, v in model_state.items() if k in trainable}, optim_state

    def load_loader(self, path: str | os.PathLike, loader: Any = None) -> None:
        """Restores this rank's loader state from the checkpoint ``path`` (into ``loader``, or the attached one).

        At the number of ranks that saved it, this rank's ``loader-rank{r}.pt``; at another, the list of every saved
        rank's state (``RolloutLoader.load_state_dict`` merges them and takes this rank's share; the files are memory
        mapped, so only the groups this rank now owns are read).
        """
        import torch

        if loader is not None:
            self.loader = loader
        path = Path(path)
        saved_world = self.dir.world_size_of(path)
        if saved_world == self.world_size:
            self.loader.load_state_dict(torch.load(path / f"loader-rank{self.rank}.pt", weights_only=True))
            return
        self.loader.load_state_dict([torch.load(path / f"loader-rank{r}.pt", weights_only=True, mmap=True)
                                     for r in range(saved_world)])
