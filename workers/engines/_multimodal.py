"""The engines' side of image prompts: the image inputs of one generate call (HF: the processor's tensors; vLLM:
``multi_modal_data`` with PIL images).

The prompt ids already hold the image placeholders (rendered once by :mod:`asyncrl.data.prompts` with the model's
processor, :func:`asyncrl.models.load_processor`), so only the images are processed here, from the exact bytes the
lease carried (:func:`asyncrl.data.images.prompt_images`). Called on the engine's thread; blocks only on decoding.
"""

from __future__ import annotations

from typing import Any

from asyncrl.data.images import decode_image, processor_inputs, prompt_images

__all__ = ["hf_image_inputs", "vllm_image_data"]


def hf_image_inputs(processor: Any | None, prompts: list[Any], *, device: Any = None, dtype: Any = None
                    ) -> dict[str, Any]:
    """The image tensors for ``generate`` over rows with these prompt items (one per row, copies included).

    Raises:
        ValueError: a row has images but the model has no processor (a text-only model); an image that does not
            decode (:class:`asyncrl.data.images.ImageError`).
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
