"""Faults for ``asyncrl check``'s tests, injected through real plug points: engine subclasses selected with
``--engine tests.integration._check_faults:Class``, and a model directory edited on disk.

Each engine is an HF (or vLLM) engine that gets one thing wrong the way a buggy engine integration would, while
reporting success: the check must fail the right stage and name the tensor or token.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from workers.engines.hf import HFEngine
from workers.engines.vllm_engine import VLLMEngine

__all__ = ["BrokenEngine", "IgnoresLoraEngine", "IgnoresLoraVLLMEngine", "OneBehindEngine", "QKSwapEngine", "TiedNotUpdatedEngine",
           "mha_tied_model"]

Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


def mha_tied_model(src: str | Path, dst: str | Path) -> Path:
    """The tiny model edited on disk into one with as many k/v heads as q heads (each kv head repeated: the same
    function) and tied embeddings (``lm_head`` dropped, ``embed_tokens`` serves both), so q and k have one shape."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copytree(src, tmp)
    config = json.loads((tmp / "config.json").read_text())
    repeat = config["num_attention_heads"] // config["num_key_value_heads"]
    config.update(num_key_value_heads=config["num_attention_heads"], tie_word_embeddings=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(tmp / "model.safetensors")
    head_dim = config["head_dim"]
    for name in list(tensors):
        if ".k_proj." in name or ".v_proj." in name:
            t = tensors[name]
            heads = t.reshape(-1, head_dim, *t.shape[1:])
            tensors[name] = heads.repeat_interleave(repeat, dim=0).reshape(-1, *t.shape[1:]).contiguous()
    tensors.pop("lm_head.weight", None)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(dst)
    return dst


class QKSwapEngine(HFEngine):
    """Loads layer 0's q_proj into k_proj's place and k_proj into q_proj's (a fused-projection order bug)."""

    def apply_weights(self, update: Any) -> None:
        if update.mode == "full" and Q in update.tensors:
            tensors = dict(update.tensors)
            tensors[Q], tensors[K] = update.tensors[K], update.tensors[Q]
            update = dataclasses.replace(update, tensors=tensors)
        super().apply_weights(update)


class TiedNotUpdatedEngine(HFEngine):
    """Updates ``embed_tokens`` but leaves the tied ``lm_head`` on its old values (the tie broken by a loader that
    copies into fresh storage)."""

    def apply_weights(self, update: Any) -> None:
        old = self.model.lm_head.weight.detach().clone()
        super().apply_weights(update)
        self.model.lm_head.weight = torch.nn.Parameter(old, requires_grad=False)


class OneBehindEngine(HFEngine):
    """Applies the previous update's weights under the new version (an engine one update behind)."""

    _previous: Any = None

    def apply_weights(self, update: Any) -> None:
        current = dataclasses.replace(update, tensors={k: v.clone() for k, v in update.tensors.items()})
        if self._previous is not None:
            super().apply_weights(dataclasses.replace(self._previous, version=update.version))
        else:
            super().apply_weights(update)
        self._previous = current


class IgnoresLoraEngine(HFEngine):
    """Loads the first LoRA adapter and ignores every later one, reporting the new version."""

    _loaded = False

    def apply_weights(self, update: Any) -> None:
        if update.mode == "lora" and self._loaded:
            self.policy_version = update.version
            return
        super().apply_weights(update)
        self._loaded = self._loaded or update.mode == "lora"


class IgnoresLoraVLLMEngine(VLLMEngine):
    """vLLM: writes the first adapter and ignores later ones (its LoRA checksums cannot be read back)."""

    _loaded = False

    def apply_weights(self, update: Any) -> None:
        if update.mode == "lora" and self._loaded:
            self.llm.update_weight_version(str(update.version))
            self.policy_version = update.version
            return
        super().apply_weights(update)
        self._loaded = self._loaded or update.mode == "lora"


class BrokenEngine(HFEngine):
    """Fails at start-up (the runner must report it as the stages' failure and go on)."""

    def __init__(self, config: Any):
        raise RuntimeError("deliberately broken engine")
