"""The engines' side of image prompts: which model class a directory needs, its processor, and the image inputs of
one generate call (HF: the processor's tensors; vLLM: ``multi_modal_data`` with PIL images).

The prompt ids already hold the image placeholders (rendered once by :mod:`asyncrl.data` with the model's
processor), so only the images are processed here, from the exact bytes the lease carried
(:func:`asyncrl.images.prompt_images`). Called on the engine's thread; blocks only on decoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.images import decode_image, processor_inputs, prompt_images

__all__ = ["hf_image_inputs", "is_multimodal", "load_causal_lm", "load_processor", "vllm_image_data"]


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


def hf_image_inputs(processor: Any | None, prompts: list[Any], *, device: Any = None, dtype: Any = None
                    ) -> dict[str, Any]:
    """The image tensors for ``generate`` over rows with these prompt items (one per row, copies included).

    Raises:
        ValueError: a row has images but the model has no processor (a text-only model); an image that does not
            decode (:class:`asyncrl.images.ImageError`).
    """
    images = [prompt_images(p) for p in prompts]
    if not any(images):
        return {}
    if processor is None:
        raise ValueError("an image prompt was leased to an engine whose model has no vision tower (no "
                         "vision_config in its config.json): give image data to a vision-language model")
    return processor_inputs(processor, images, device=device, dtype=dtype)


def vllm_image_data(prompt: Any) -> dict[str, Any] | None:
    """``{"image": [PIL images]}`` for vLLM's ``multi_modal_data`` of one prompt item, None for a text prompt."""
    images = prompt_images(prompt)
    if not images:
        return None
    return {"image": [decode_image(data, what=f"prompt image {i}") for i, data in enumerate(images)]}
