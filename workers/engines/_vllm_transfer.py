"""asyncrl's backend for vLLM's native weight-transfer API (full updates; private to the vLLM engine).

vLLM 0.32 drives a weight update in four calls that its ``LLM`` exposes (``RLOfflineMixin``) and its worker
(GPU ``Worker``, which ``CPUWorker`` inherits) forwards to a :class:`WeightTransferEngine` chosen by
``LLM(weight_transfer_config={"backend": ...})``. Its own backends (``nccl``, ``ipc``, ...) need CUDA; this one,
registered as ``asyncrl`` with ``WeightTransferEngineFactory.register_engine``, loads what an asyncrl receiver has
already staged and verified, on any device::

    worker main thread, at the safe point (VLLMEngine.apply_weights(update)):
      info = offer(update)                  the staged tensors: by reference (vLLM's worker runs in this process)
                                            or as the shm segment's address and offsets (another process)
      llm.start_weight_update()         ──► initialize_layerwise_reload: layers to meta, loaders deferred
      llm.update_weights(info)          ──► receive_weights: resolve views, check every name and shape against the
                                            model, model.load_weights(views) (each layer copied in when complete)
      llm.finish_weight_update(weight_version=str(v))
                                        ──► finalize_layerwise_reload; every output from now on reports version v
      receiver.commit(v)                    (the worker) phase two: asyncrl's commit is vLLM's finish

That is the sequence ``reload_weights`` runs (``initialize_layerwise_reload`` -> ``model.load_weights`` ->
``finalize_layerwise_reload``), which works on CPU, where ``model.load_weights`` alone does not (vLLM packs CPU
linear weights and empties ``layer.weight``). What it saves against the RPC path it replaces: no safetensors
serialization and no extra copy per update; the engine reads the shm segment's pages (or the receive buffer)
directly into its parameters.

Failure: anything wrong with an update (a tensor the model lacks, a wrong shape, a segment that vanished or was
reused) is found before a single weight is loaded; the engine then finalizes the reload with nothing loaded, which
puts every layer's old tensors back, and re-raises: the model keeps the committed version. Who blocks: every call
runs in the worker's thread (in-process) or in vLLM's worker process, synchronously.

The in-process table of offers (:data:`_OFFERS`) is keyed by a token per update and emptied by :func:`withdraw`
right after ``update_weights`` returns; tensors never travel through ``collective_rpc``'s serializer.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from asyncrl.codec import TENSOR_DTYPES

__all__ = ["BACKEND", "AsyncrlWeightTransferEngine", "offer", "register", "withdraw"]

logger = logging.getLogger("asyncrl.vllm")

BACKEND = "asyncrl"
"""The name the engine is registered under (``weight_transfer_config={"backend": BACKEND}``)."""

_OFFERS: dict[str, list[tuple[str, torch.Tensor]]] = {}
"""Updates offered by reference to a vLLM worker in this process, by token (see :func:`offer`)."""


def register() -> None:
    """Registers the engine with vLLM's factory (idempotent). Must run in vLLM's worker process before it loads the
    model: in-process by :class:`~workers.engines.vllm_engine.VLLMEngine`, in multiprocess mode at the import of the
    worker extension (``workers.engines._vllm_ext``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # no public lookup; register_engine refuses a repeat
        WeightTransferEngineFactory.register_engine(BACKEND, AsyncrlWeightTransferEngine)


# -- the asyncrl side (the worker's thread) --------------------------------------------------------
def offer(update: Any) -> dict[str, Any]:
    """The ``update_info`` that lets the engine load ``update`` (a full :class:`~asyncrl.weights.WeightUpdate`).

    By reference for a vLLM worker in this process; for one in another process the update must be staged in a shm
    segment (``metadata["segment_path"]``, set by :class:`~asyncrl.weights.shm.ShmWeightReceiver`), whose
    tensors are then described by their byte offsets in the file. Call :func:`withdraw` with the result afterwards.
    """
    token = secrets.token_hex(8)
    _OFFERS[token] = list(update.tensors.items())
    info: dict[str, Any] = {"version": int(update.version), "pid": os.getpid(), "token": token}
    meta = update.metadata or {}
    if "segment_path" in meta:
        info["segment"] = _segment_info(update.tensors, meta["segment_path"], int(meta.get("publish", 0)))
    return info


def withdraw(info: dict[str, Any]) -> None:
    _OFFERS.pop(info.get("token", ""), None)


def _segment_info(tensors: dict[str, torch.Tensor], path: str, publish: int) -> dict[str, Any] | None:
    """``{path, publish, tensors: [[name, dtype, shape, offset], ...]}`` if every tensor is a contiguous view into
    one buffer (the segment's mapping, which starts at the file's byte 0), else None."""
    rows, base = [], None
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if t.numel() == 0:
            rows.append([name, dtype, list(t.shape), -1])
            continue
        storage = t.untyped_storage().data_ptr()
        if t.device.type != "cpu" or not t.is_contiguous() or base not in (None, storage):
            return None
        base = storage
        rows.append([name, dtype, list(t.shape), t.data_ptr() - storage])
    return {"path": path, "publish": publish, "tensors": rows}


# -- vLLM's side (its worker: this process or another) ---------------------------------------------
@dataclass
class AsyncrlInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the data plane is asyncrl's receiver."""


@dataclass
class AsyncrlUpdateInfo(WeightTransferUpdateInfo):
    version: int
    """The policy version being loaded (logs and errors)."""
    pid: int
    """The process that offered it: the tensors are taken by reference when it is this one."""
    token: str = ""
    """The offer's key in that process's :data:`_OFFERS`."""
    segment: dict[str, Any] | None = field(default=None)
    """The shm segment holding the tensors, for a worker in another process (see :func:`offer`)."""


class AsyncrlWeightTransferEngine(WeightTransferEngine[AsyncrlInitInfo, AsyncrlUpdateInfo]):
    """Loads asyncrl's staged, verified tensors into vLLM's model through layerwise reload (see the module)."""

    init_info_cls = AsyncrlInitInfo
    update_info_cls = AsyncrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._maps: dict[str, tuple[int, mmap.mmap, torch.Tensor]] = {}
        self._reloading = False
        self.loaded = 0
        """Tensors loaded by the last update."""

    def init_transfer_engine(self, init_info: AsyncrlInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Loads one update (the base class's version synchronizes an accelerator, which raises on CPU: ``Cannot
        access accelerator device when none is available``); on any error puts the old weights back first."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._abort()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: AsyncrlUpdateInfo) -> None:
        if not self._reloading:
            raise RuntimeError("update_weights without start_weight_update")
        weights = self._resolve(update_info)
        self._check(update_info.version, weights)
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(iter(weights))
        self.loaded = len(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._maps.clear()

    # -- internals -------------------------------------------------------------------------------
    def _abort(self) -> None:
        """Nothing was loaded: finalizing puts every layer's kernel tensors (the committed weights) back in place."""
        if self._reloading:
            try:
                self.finish_weight_update()
            except Exception:  # the original error is the one to report
                logger.exception("finalizing an aborted weight update failed")

    def _resolve(self, info: AsyncrlUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        if info.pid == os.getpid():
            weights = _OFFERS.get(info.token)
            if weights is None:
                raise ValueError(f"version {info.version}: no offered update {info.token!r:.20} in process {info.pid}")
            return weights
        if info.segment is None:
            raise ValueError(f"version {info.version} was offered by process {info.pid} but not staged in a shm "
                             f"segment: it cannot reach vLLM's worker process {os.getpid()} this way")
        return self._segment_views(info.version, info.segment)

    def _segment_views(self, version: int, seg: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        from asyncrl.weights.shm import _HEADER, MAGIC

        path, publish = str(seg["path"]), int(seg["publish"])
        mm, buf = self._map(version, path)
        if len(mm) < _HEADER.size:
            raise ValueError(f"version {version}: segment {path} is {len(mm)} bytes, too short for its header")
        magic, held_publish = _HEADER.unpack_from(mm, 0)[:2]
        if magic != MAGIC or held_publish != publish:  # the offering receiver holds the slot: this is a wrong peer
            raise ValueError(f"version {version}: segment {path} holds publish {held_publish} (magic {magic:#x}), "
                             f"not the offered publish {publish}")
        out = []
        for name, dtype, shape, offset in seg["tensors"]:
            if dtype not in TENSOR_DTYPES:
                raise ValueError(f"version {version}: tensor {name!r:.100} has unknown dtype {dtype!r:.20}")
            dt = TENSOR_DTYPES[dtype]
            n = dt.itemsize
            for d in shape:
                n *= int(d)
            if offset == -1 and n == 0:
                out.append((name, torch.empty(shape, dtype=dt)))
                continue
            if not 0 <= offset <= buf.numel() - n or offset % dt.itemsize:
                raise ValueError(f"version {version}: tensor {name!r:.100} at [{offset}, {offset + n}) is outside "
                                 f"segment {path} ({buf.numel()} bytes) or misaligned")
            out.append((name, buf[offset : offset + n].view(dt).view(shape)))
        return out

    def _map(self, version: int, path: str) -> tuple[mmap.mmap, torch.Tensor]:
        """A read-only mapping of one segment file, kept across versions (a layout maps two: its slots)."""
        for old in [p for p in self._maps if p != path and not os.path.exists(p)]:
            del self._maps[old]  # a replaced segment
        try:
            st = os.stat(path)
            cached = self._maps.get(path)
            if cached is not None and cached[0] == st.st_ino:
                return cached[1], cached[2]
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            raise ValueError(f"version {version}: cannot map segment {path}: {e}") from e
        import warnings

        with warnings.catch_warnings():  # read-only on purpose: the loaders only read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._maps[path] = (st.st_ino, mm, buf)
        return mm, buf

    def _check(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Refuses, before anything is loaded, a name the model does not hold or a shape that does not fit it
        (loading it would leave a layer half-written: layerwise reload copies a layer once all of it arrived)."""
        packed = {shard: fused for fused, shards in getattr(self.model, "packed_modules_mapping", {}).items()
                  for shard in shards}
        for name, t in weights:
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            fused = leaf in packed
            target = f"{parent}.{packed[leaf]}" if fused else module_path
            try:
                module = self.model.get_submodule(target)
                module = getattr(module, "base_layer", module)  # a LoRA wrapper holds the weights in its base layer
                param = getattr(module, param_name)
            except AttributeError:
                raise ValueError(f"version {version}: the engine's model has no tensor for {name!r:.100} "
                                 f"(looked for {target}.{param_name})") from None
            want = list(param.shape)
            got = list(t.shape)
            rows = getattr(module, "org_vocab_size", None)
            if fused:
                ok = len(got) == len(want) and got[1:] == want[1:] and got[0] <= want[0]
            elif rows is not None and got and want:
                ok = got[0] == rows and got[1:] == want[1:]
            else:
                ok = got == want
            if not ok:
                raise ValueError(f"version {version}: tensor {name!r:.100} has shape {got}, the engine's "
                                 f"{target}.{param_name} is {want}")
