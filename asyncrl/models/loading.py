"""Loading a model directory: the model class it needs (a causal LM, or a vision-language model when its config has
a vision tower) and, for a vision-language model, its processor.

The trainer (``recipes/grpo.py``), the HF engine and the debugger load through these, so every process builds the
same class from the same directory. Blocks on reading the directory; transformers is imported on first use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["is_multimodal", "load_causal_lm", "load_processor"]


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
