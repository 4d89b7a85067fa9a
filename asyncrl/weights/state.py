"""The policy's publishable state: what a broadcaster sends for a plain, DDP, FSDP2 (DTensor) or peft model.

::

    every rank:  state = policy_state(model, mode, bucket_bytes=...)      (names, dtypes, shapes: no data)
                 with state:                                              (exit: the rest of the gathers)
    rank 0:          broadcaster.publish(state, v, mode=state.mode, lora_config=state.lora_config)
                         └─ fills bucket after bucket; the first access to a tensor of group g
                            gathers g (``full_tensor()`` of each of its DTensors) and frees g - 1
    other ranks:     (nothing)   └─ ``__exit__`` gathers every group in the same order, then frees it

Modes: ``full`` publishes the model's state dict under the names the engines load (HF names: a DDP
wrapper's ``module.`` is not part of them; a peft model's LoRA layers are merged into their base weights,
``W + scaling * B @ A``, under the base layer's name); ``lora`` publishes only the adapter, under
``get_peft_model_state_dict``'s names, with its ``LoraConfig`` as a JSON-able dict.

FSDP2 streams: tensors are grouped, in state-dict order, into groups of at most ``bucket_bytes`` (a larger
tensor is a group of its own), and only one group is ever gathered: extra memory is at most one group per
rank (:attr:`PolicyState.peak_bytes`). Every rank must enter the ``with`` block for every publish, because
every ``full_tensor()`` is a collective; the gathers run in the same order on every rank, and rank 0 runs the
ones its broadcaster did not ask for (it raised, or skipped tensors) on exit, so no rank is left waiting.
A broadcaster reads the metadata without gathering through :attr:`PolicyState.specs`
(:func:`asyncrl.weights.base.tensor_specs`) and each tensor once, in order; an access out of order is a
``RuntimeError`` naming both tensors. Plain and DDP models hold full tensors: nothing is gathered or copied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["PolicyState", "policy_state"]

StateMode = Literal["full", "lora"]
_Entry = tuple[str, list[torch.Tensor], Callable[[list[torch.Tensor]], torch.Tensor] | None]
"""(name, source tensors, combine): the published tensor is ``combine(full sources)`` or the only source."""


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor's all-gather (a collective)


def _is_distributed(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor")


def _spec(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2's ``fully_shard`` wraps nothing: it changes the module's class)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _peft_parts(model: nn.Module) -> tuple[Any, str] | None:
    """``(peft model, active adapter name)`` for a peft model, else None."""
    if not hasattr(model, "peft_config") or not hasattr(model, "get_base_model"):
        return None
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    return model, adapter


def _lora_config(peft_model: Any, adapter: str) -> dict[str, Any]:
    config = peft_model.peft_config[adapter].to_dict()
    return {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in config.items()}


def _lora_entries(peft_model: Any, adapter: str) -> list[_Entry]:
    from peft import get_peft_model_state_dict

    keys = list(get_peft_model_state_dict(peft_model, adapter_name=adapter))  # names only (DTensors: no gather)
    by_key = {}
    for fqn, p in peft_model.named_parameters():
        by_key.setdefault(fqn.replace(f".{adapter}.", "."), p)
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise ValueError(f"lora state: adapter keys without a parameter {missing[:4]} (adapter {adapter!r})")
    return [(k, [by_key[k]], None) for k in keys]


def _merge(scaling: float, fan_in_fan_out: bool) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def merge(full: list[torch.Tensor]) -> torch.Tensor:
        base, a, b = full
        delta = (b @ a) * scaling
        return base + (delta.T if fan_in_fan_out else delta).to(base.dtype)

    return merge


def _merged_entries(peft_model: Any, adapter: str) -> list[_Entry]:
    """The base model's state dict under HF names, each LoRA linear's weight merged with its adapter."""
    from peft.tuners.lora import Linear as LoraLinear

    base = peft_model.get_base_model()
    merged: dict[str, _Entry] = {}
    for path, module in base.named_modules():
        if adapter not in getattr(module, "lora_A", {}):
            continue
        if not isinstance(module, LoraLinear) or module.use_dora.get(adapter, False):
            raise ValueError(f"full state of a peft model: {path} is a {type(module).__name__} (DoRA or not a "
                             "Linear LoRA layer); publish mode='lora' instead")
        sources = [module.base_layer.weight, module.lora_A[adapter].weight, module.lora_B[adapter].weight]
        merged[f"{path}.weight"] = (f"{path}.weight", sources, _merge(module.scaling[adapter], module.fan_in_fan_out))
    entries: list[_Entry] = []
    for name, t in base.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        hf_name = name.replace(".base_layer.", ".")
        entries.append(merged.get(hf_name) or (hf_name, [t], None))
    return entries


def _groups(entries: list[_Entry], bucket_bytes: int) -> list[list[int]]:
    """Entry indices in order, packed into groups of at most ``bucket_bytes`` of published bytes."""
    groups: list[list[int]] = []
    size = 0
    for i, (_, sources, _) in enumerate(entries):
        nbytes = sources[0].numel() * sources[0].element_size()
        if groups and size + nbytes <= bucket_bytes:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
    return groups


class PolicyState(Mapping[str, torch.Tensor]):
    """The publishable tensors of one policy version, gathered one group at a time (see the module docstring).

    Attributes:
        mode: ``full`` or ``lora``.
        lora_config: ``lora`` mode: the adapter's ``LoraConfig`` as a dict; else None.
        specs: name -> a ``meta`` tensor with the published dtype and shape (no data, no gather).
        nbytes: bytes of the published tensors.
        peak_bytes: the most bytes this rank held gathered at once (0 when nothing is distributed).
    """

    def __init__(self, entries: list[_Entry], mode: StateMode, lora_config: dict[str, Any] | None,
                 bucket_bytes: int):
        if bucket_bytes <= 0:
            raise ValueError(f"{bucket_bytes=} must be > 0")
        self.mode, self.lora_config = mode, lora_config
        self._entries = entries
        self._index = {name: i for i, (name, _, _) in enumerate(entries)}
        if len(self._index) != len(entries):
            raise ValueError("policy state: two tensors publish under one name")
        self.specs = {name: _spec(sources[0]) for name, sources, _ in entries}
        self.nbytes = sum(s.numel() * s.element_size() for s in self.specs.values())
        self.streamed = any(_is_distributed(t) for _, sources, _ in entries for t in sources)
        self._groups = _groups(entries, bucket_bytes)
        self._group_of = {i: g for g, members in enumerate(self._groups) for i in members}
        self._next_group = 0
        self._current: dict[str, torch.Tensor] = {}
        self._current_group = -1
        self.peak_bytes = 0

    # -- Mapping ---------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __getitem__(self, name: str) -> torch.Tensor:
        """The published tensor (gathered if distributed). Streamed: valid until a later group is accessed."""
        if name not in self._index:
            raise KeyError(name)
        if not self.streamed:
            return self._materialize(self._index[name])
        group = self._group_of[self._index[name]]
        if group != self._current_group:
            if group < self._next_group:
                raise RuntimeError(f"policy state: {name!r} (gather group {group}) accessed after group "
                                   f"{self._current_group} was gathered; a streamed state is read once, in order")
            while self._next_group <= group:  # tensors skipped by the reader are gathered too: every rank does
                self._gather_next()
        return self._current[name]

    # -- streaming -------------------------------------------------------------------------------------------
    def _materialize(self, i: int) -> torch.Tensor:
        _, sources, combine = self._entries[i]
        full = [_full(t.detach()) for t in sources]
        return combine(full) if combine is not None else full[0]

    def _gather_next(self) -> None:
        self._current = {}  # free the previous group first: at most one group alive
        g = self._next_group
        self._next_group += 1
        self._current = {self._entries[i][0]: self._materialize(i) for i in self._groups[g]}
        self._current_group = g
        held = sum(t.numel() * t.element_size() for t in self._current.values())
        self.peak_bytes = max(self.peak_bytes, held)

    def finish(self) -> None:
        """Runs the gathers not done yet (every rank must: they are collectives) and frees the last group."""
        if self.streamed:
            while self._next_group < len(self._groups):
                self._gather_next()
        self._current = {}

    def __enter__(self) -> PolicyState:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


def policy_state(model: nn.Module, mode: StateMode | None = None, *, bucket_bytes: int = 64 << 20) -> PolicyState:
    """The publishable state of ``model`` (plain, DDP-wrapped, FSDP2-sharded, peft, or FSDP2 + peft).

    Args:
        model: the trained module (a DDP wrapper is unwrapped; FSDP2 parameters are DTensors).
        mode: ``lora`` (adapter keys only; needs a peft model) or ``full`` (the merged weights under HF names).
            None: ``lora`` for a peft model, else ``full``.
        bucket_bytes: most bytes gathered at once per rank (the weight sync's ``bucket_bytes``).

    Raises:
        ValueError: ``lora`` for a model without an adapter; ``full`` for a peft model with non-Linear or
            DoRA adapter layers.
    """
    model = _unwrap(model)
    peft = _peft_parts(model)
    mode = mode or ("lora" if peft is not None else "full")
    if mode == "lora":
        if peft is None:
            raise ValueError(f"mode='lora' needs a peft model, got {type(model).__name__}; publish mode='full'")
        return PolicyState(_lora_entries(*peft), "lora", _lora_config(*peft), bucket_bytes)
    if mode != "full":
        raise ValueError(f"{mode=} must be 'full' or 'lora'")
    if peft is not None:
        return PolicyState(_merged_entries(*peft), "full", None, bucket_bytes)
    entries = [(name, [t], None) for name, t in model.state_dict(keep_vars=True).items()]
    return PolicyState(entries, "full", None, bucket_bytes)
