"""Images in prompts: encoded bytes end to end, decoded and checked with Pillow, named by their SHA-256.

::

    dataset item {"messages": [... {"type": "image"} ...], "images": [bytes | path, ...]}
        │ load_prompts: paths read, each image decoded once (refused with ImageError), prompt_ids rendered by the
        │ model's processor (its image placeholder repeated once per image token)
        ▼
    lease payload: the item, images as msgpack bytes (no pickle) ──► worker: engine decodes them (PIL) for the
        │                                                              processor (HF) / multi_modal_data (vLLM)
        ▼
    Rollout.images (the same bytes) + metadata["images"] = provenance ──► gate: every image decodes, its hash and
        │                                                                   size match, within MAX_IMAGE_BYTES
        ▼
    TrainBatch["images"] ──► trainer: processor_inputs(processor, images) = the pixel inputs the engine used

The bytes are never re-encoded: what the dataset held is what the engine, the gate, the trainer, a dump and a
replay see, so a hash names one image everywhere. Pure functions; nothing here blocks but the file system.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "ImageError",
    "decode_image",
    "image_bytes",
    "image_provenance",
    "processor_inputs",
    "prompt_images",
    "render_image_prompt",
    "verify_images",
    "vision_token_ids",
]

MAX_IMAGE_BYTES = 8 * 1024 * 1024
"""Largest encoded image accepted (each one); the wire's own message limit bounds the total."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest decoded image (width x height) accepted: a small file that decodes to gigabytes is refused."""
MAX_IMAGES = 16
"""Most images one prompt may carry."""


class ImageError(ValueError):
    """An image that cannot be used: unreadable, not decodable, too large, or not what its provenance says."""


def image_bytes(image: Any) -> bytes:
    """The encoded bytes of a dataset item's image: bytes as given, a path read, ``{"bytes": ...}`` (the form
    ``datasets``' ``Image`` feature stores) or ``{"path": ...}``.

    Raises:
        ImageError: not one of these forms, or a path that cannot be read.
    """
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        try:
            with open(image, "rb") as f:
                return f.read()
        except OSError as e:
            raise ImageError(f"cannot read image {os.fspath(image)!r}: {e}") from e
    raise ImageError(f"an image must be bytes, a path or {{'bytes'|'path': ...}}, got {type(image).__name__}")


def decode_image(data: bytes, *, what: str = "image"):
    """Decodes and fully loads encoded image bytes as an RGB ``PIL.Image``.

    Raises:
        ImageError: over :data:`MAX_IMAGE_BYTES` / :data:`MAX_IMAGE_PIXELS`, or Pillow cannot decode it (a truncated
            or corrupted file), with ``what`` and the reason in the message.
    """
    from PIL import Image

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"{what} must be encoded bytes, got {type(data).__name__}")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{what} has {len(data)} bytes, more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES}")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.verify()  # the file's own integrity checks (PNG chunk CRCs), which decoding alone skips
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageError(f"{what} is {width}x{height}, more than MAX_IMAGE_PIXELS={MAX_IMAGE_PIXELS}")
            im.load()  # decodes every pixel: a truncated or corrupted file fails here, not in the processor
            return im.convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # Pillow raises many types (OSError, SyntaxError, ValueError...) for bad bytes
        raise ImageError(f"{what} ({len(data)} bytes) does not decode: {type(e).__name__}: {e}") from e


def image_provenance(data: bytes) -> dict[str, Any]:
    """What names an image in a rollout, a batch and a dump: ``{"sha256", "nbytes", "format", "width", "height"}``.

    Raises:
        ImageError: the bytes do not decode (:func:`decode_image`).
    """
    from PIL import Image

    decode_image(data)
    with Image.open(io.BytesIO(data)) as im:
        fmt, (width, height) = im.format, im.size
    return {"sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data), "format": fmt, "width": width,
            "height": height}


def verify_images(images: Sequence[Any], provenance: Sequence[Any] | None = None, *, what: str = "prompt") -> None:
    """Checks a rollout's or an item's images: at most :data:`MAX_IMAGES`, each bytes that decode, and (given) each
    matching its provenance's ``sha256`` and ``nbytes``.

    Raises:
        ImageError: naming the image (``what[i]``) and the reason.
    """
    if len(images) > MAX_IMAGES:
        raise ImageError(f"{what} has {len(images)} images, more than MAX_IMAGES={MAX_IMAGES}")
    if provenance is not None and len(provenance) != len(images):
        raise ImageError(f"{what} has {len(images)} images but provenance for {len(provenance)}")
    for i, data in enumerate(images):
        decode_image(data, what=f"{what} image {i}")
        if provenance is not None:
            p = provenance[i]
            digest = hashlib.sha256(data).hexdigest()
            if not isinstance(p, dict) or p.get("sha256") != digest or p.get("nbytes") != len(data):
                raise ImageError(f"{what} image {i}: sha256 {digest} / {len(data)} bytes do not match its provenance "
                                 f"{p!r:.200}")


def processor_inputs(processor: Any, images: Sequence[Sequence[bytes]], *, device: Any = None,
                     dtype: Any = None) -> dict[str, Any]:
    """The model's image inputs for a batch, rows in order: what ``model(...)`` / ``generate`` takes beside the ids.

    Args:
        processor: the model directory's ``AutoProcessor`` (its ``image_processor`` is run, the tokenizer is not:
            the prompt ids already hold the image placeholders).
        images: per row, that row's encoded images (rows without images contribute nothing).
        device: where the tensors go (None: CPU).
        dtype: the floating tensors' dtype (the model's; None: the processor's float32).

    Returns:
        ``{}`` when no row has an image; else the image processor's tensors, e.g. ``pixel_values`` (LLaVA) or
        ``pixel_values`` + ``image_grid_thw`` (Qwen2-VL), images concatenated in row order.
    """
    flat = [decode_image(data, what=f"row {row} image {i}") for row, datas in enumerate(images)
            for i, data in enumerate(datas)]
    if not flat:
        return {}
    out = processor.image_processor(images=flat, return_tensors="pt")
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in out.items()}


def prompt_images(prompt: Any) -> list[bytes]:
    """The encoded images of a leased prompt item (``item["images"]``, bytes or paths); ``[]`` for a text prompt.

    Raises:
        ImageError: an image that cannot be read (:func:`image_bytes`).
    """
    if not isinstance(prompt, dict) or not prompt.get("images"):
        return []
    images = prompt["images"]
    if not isinstance(images, list):
        raise ImageError(f"a prompt's 'images' must be a list, got {type(images).__name__}")
    return [image_bytes(x) for x in images]


def render_image_prompt(messages: Any, images: Sequence[bytes], processor: Any, *,
                        system_prompt: str | None = None) -> list[int]:
    """The prompt ids of chat turns with image parts: the chat template, then the model's processor, which repeats
    each image's placeholder once per image token (so the ids are what the model and every engine see).

    Raises:
        ImageError: no processor (a text-only model), turns that are not a list, a count of ``{"type": "image"}``
            parts that differs from the images', or an image that does not decode.
    """
    if processor is None or not hasattr(processor, "image_processor"):
        raise ImageError("an image prompt needs a vision-language model's processor (its model directory has none): "
                         "load the prompts with the model directory of a VLM")
    if not isinstance(messages, list):
        raise ImageError(f"an image prompt must be chat turns (a list of messages), got {type(messages).__name__}")
    verify_images(images)
    parts = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")
    if parts != len(images):
        raise ImageError(f"the messages reference {parts} images ({{'type': 'image'}} parts), the row has "
                         f"{len(images)}")
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [decode_image(data) for data in images]
    return processor(text=[text], images=pil, add_special_tokens=False)["input_ids"][0]


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<image>")
"""Image markup tokens a prompt may hold and a response never may (Qwen2-VL's, LLaVA's)."""


def vision_token_ids(processor: Any) -> list[int]:
    """The ids a vision-language policy must never sample: its image placeholder and image markup tokens.

    A sampled placeholder in a response would be an image slot without an image: the trainer's forward refuses
    it ("image features and image tokens do not match"). Engines suppress these ids (logit -inf before the
    temperature, as ``generate(suppress_tokens=...)`` does) and :func:`asyncrl.train.logprobs.token_logprobs` applies
    the same suppression, so both sides score the same distribution. ``[]`` for None (a text-only model).
    """
    if processor is None:
        return []
    tok = getattr(processor, "tokenizer", processor)
    vocab = tok.get_vocab()
    ids = {vocab[t] for t in (*VISION_TOKENS, getattr(processor, "image_token", None)) if t in vocab}
    return sorted(ids)
