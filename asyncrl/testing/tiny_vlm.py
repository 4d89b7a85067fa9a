"""A tiny LLaVA-architecture vision-language model with the BPE tokenizer of ``tiny_bpe``, built locally.

``LlavaForConditionalGeneration`` with a CLIP vision tower and a Qwen2 language model is an architecture that both
HF transformers (5.19) and vLLM (0.32, CPU) run from a local directory, with a processor (``LlavaProcessor``: a
``CLIPImageProcessor`` on PIL plus the tokenizer) that needs nothing beyond Pillow. Qwen2-VL was the first choice
and does not work here: transformers builds ``Qwen2VLProcessor`` only with its video processor, which needs
torchvision, and no torchvision wheel loads against the CPU torch of this environment (see the NOTES); both the
engines and the trainer run whatever the model's processor returns (``pixel_values``, and ``image_grid_thw`` for a
Qwen2-VL model), so a Qwen2-VL directory works unchanged where torchvision is installed.

At a tiny scale the directory looks like a LLaVA-1.5 model on a Qwen2.5 language model:

- the tokenizer is :mod:`asyncrl.testing.tiny_bpe` 's byte-level BPE plus the vision special tokens
  ``<|vision_start|>``, ``<|image_pad|>`` (the image placeholder the processor repeats once per image patch) and
  ``<|vision_end|>``;
- the chat template is ChatML where a message's ``content`` is a string or a list of ``{"type": "text", "text":
  ...}`` / ``{"type": "image"}`` parts, an image rendered as ``<|vision_start|><|image_pad|><|vision_end|>``;
- the image processor resizes and centre-crops to :data:`IMAGE_SIZE` px (CLIP's mean/std), so an image is
  ``(IMAGE_SIZE // PATCH_SIZE) ** 2`` = 16 patches and 16 ``<|image_pad|>`` prompt tokens;
- the vision tower is two CLIP blocks of width 64 (head size 32), the projector a 2-layer GELU MLP, the language
  model :data:`asyncrl.testing.tiny_model.TINY_CONFIG`.

The build is deterministic (same seed, same files), written under a temporary name and renamed into place, and a
complete directory is reused. CLI: ``asyncrl tiny-model DIR --vlm [--seed N] [--dtype bfloat16]``.
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncrl.testing.tiny_model import TINY_CONFIG, save_model_dir

__all__ = ["IMAGE_SIZE", "IMAGE_TOKEN", "PATCH_SIZE", "VISION_TOKENS", "VLM_CHAT_TEMPLATE", "build_tiny_vlm", "main"]

IMAGE_TOKEN = "<|image_pad|>"
VISION_TOKENS = ["<|vision_start|>", IMAGE_TOKEN, "<|vision_end|>"]
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with Qwen2-VL's image parts, without Qwen's default system prompt and tools."""
IMAGE_SIZE = 32
"""Side of the square the image processor resizes and crops every image to, in pixels."""
PATCH_SIZE = 8
"""The vision tower's patch side: ``(IMAGE_SIZE // PATCH_SIZE) ** 2`` image tokens per image."""
VISION_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "projection_dim": 64}
"""CLIP's vision tower at a tiny scale (head size 32)."""
VOCAB_SIZE = 512


def _processor(seed: int):
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from asyncrl.testing.tiny_bpe import _tokenizer

    tokenizer = _tokenizer(seed)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="default", chat_template=VLM_CHAT_TEMPLATE,
                          image_token=IMAGE_TOKEN, num_additional_image_tokens=1)


def _complete(path: Path) -> bool:
    return all((path / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json", "processor_config.json"))


def build_tiny_vlm(path: str | os.PathLike, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Builds (or reuses) the tiny LLaVA model and its processor at ``path`` and returns the path.

    Args:
        path: the model directory; reused when complete (a partial one is rebuilt).
        seed: seeds the tokenizer's training text and the weights.
        dtype: the weights' dtype (float32, bfloat16, float16).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: the tokenizer outgrew the model's vocabulary.
    """
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    path = Path(path)
    if _complete(path):
        return path
    processor = _processor(seed)
    tokenizer = processor.tokenizer
    if len(tokenizer) > VOCAB_SIZE:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's {VOCAB_SIZE=}")
    text = dict(TINY_CONFIG, model_type="qwen2", vocab_size=VOCAB_SIZE, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype=dtype)
    config = LlavaConfig(
        vision_config=dict(VISION_CONFIG, model_type="clip_vision_model"),
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(getattr(torch, dtype))
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return save_model_dir(path, model, processor)


if __name__ == "__main__":  # the same as `asyncrl tiny-model DIR --vlm`
    from asyncrl.testing.build import main

    main(prog="python -m asyncrl.testing.tiny_vlm", kind="vlm")
