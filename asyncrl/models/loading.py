"""Loading a model directory: the model class it needs (a causal LM, or a vision-language model when its config has
a vision tower) and, for a vision-language model, its processor; and :func:`check_model_dir`, which refuses a path
that is not a model before anything tries to load it (transformers would say "Repo id must be in the form ...").

The trainer (``recipes/grpo.py``), the HF engine and the debugger load through these, so every process builds the
same class from the same directory. Blocks on reading the directory; transformers is imported on first use.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["ModelDirError", "check_model_dir", "is_multimodal", "load_causal_lm", "load_processor"]

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
"""What a model directory's weights are stored as (sharded ones come with an ``*.index.json`` beside them)."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""A Hugging Face hub model id: ``name`` or ``namespace/name``."""
TRY = ("`asyncrl check --model DIR` verifies a model directory for RL; `asyncrl tiny-model DIR` builds a tiny one to "
       "try things with")


class ModelDirError(ValueError):
    """A model path that is not a model: unset, missing, a file, without ``config.json`` or without weights."""


def check_model_dir(path: str | os.PathLike | None, *, key: str = "model") -> None:
    """Refuses ``path`` unless it is a model directory (``config.json`` and weight files) or, not being a local
    path, a hub model id (with ``HF_HUB_OFFLINE=1``: one in the local Hugging Face cache).

    Args:
        path: the model directory (or hub id).
        key: how messages name the setting (``model.path``, ``LoaderConfig.worker.engine.model``).

    Raises:
        ModelDirError: naming the key, the path and what is wrong with it.
    """
    if path is None or not str(path).strip():
        raise ModelDirError(f"{key} is not set: give the directory of a Hugging Face model (config.json, weights, "
                            f"tokenizer); {TRY}")
    local = Path(path).expanduser()
    if local.is_dir():
        _check_local(local, f"{key}={str(path)!r}")
        return
    if local.exists():
        raise ModelDirError(f"{key}={str(path)!r} is a file, not a model directory; {TRY}")
    hub_id = str(path)
    if not _HUB_ID.fullmatch(hub_id) or hub_id.startswith("."):
        raise ModelDirError(f"{key}={hub_id!r}: no such directory ({local.resolve()}); {TRY}")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
            raise ModelDirError(f"{key}={hub_id!r}: no such directory ({local.resolve()}), nor a model of that id in "
                                "the Hugging Face cache (HF_HUB_OFFLINE=1: nothing is downloaded); give the model's "
                                f"directory; {TRY}")


def _check_local(local: Path, what: str) -> None:
    """A local directory: ``config.json`` a JSON object with a ``model_type``, weight files present, every shard an
    index names present, and each ``*.safetensors`` file's header readable (its tensors are not read)."""
    if not (local / "config.json").is_file():
        held = sorted(p.name for p in local.iterdir())[:8]
        raise ModelDirError(f"{what} is not a model directory: it has no config.json (it holds {held or 'nothing'}); "
                            f"{TRY}")
    try:
        config = json.loads((local / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{what}: config.json is not valid JSON ({e}); {TRY}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelDirError(f"{what}: config.json has no model_type (is it a model's config?); {TRY}")
    if not any(next(local.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ModelDirError(f"{what} has a config.json but no weights ({', '.join(WEIGHT_FILES)}): an incomplete "
                            f"download or copy?; {TRY}")
    for index in local.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as e:
            raise ModelDirError(f"{what}: {index.name} is not a valid index ({e}); {TRY}") from None
        if missing := sorted(s for s in shards if not (local / s).is_file()):
            raise ModelDirError(f"{what}: {index.name} names {len(missing)} weight files that are not there "
                                f"({missing[:3]}): an incomplete download?; {TRY}")
    from safetensors import safe_open

    for file in sorted(local.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="np") as f:
                f.keys()
        except Exception as e:  # deliberate: safetensors raises its own error types; name the file
            raise ModelDirError(f"{what}: {file.name} is not a readable safetensors file ({e}): a truncated "
                                f"download or copy?; {TRY}") from None


def is_multimodal(model_dir: str) -> bool:
    """True for a model directory whose config has a vision tower (``vision_config``: LLaVA, Qwen2-VL, ...)."""
    path = Path(model_dir) / "config.json"
    return path.exists() and "vision_config" in json.loads(path.read_text())


def load_causal_lm(model_dir: str, dtype: Any):
    """``AutoModelForImageTextToText`` for a vision-language directory, ``AutoModelForCausalLM`` otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_multimodal(model_dir) else AutoModelForCausalLM
    return auto.from_pretrained(model_dir, dtype=dtype)


def load_processor(model_dir: str) -> Any | None:
    """The directory's ``AutoProcessor`` for a vision-language model; None for a text-only one."""
    if not is_multimodal(model_dir):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)
