"""The tiny VLM builder: deterministic, reused when complete, loads as a LLaVA model with its processor (no hub),
the vision special tokens in its tokenizer and a chat template that places them; the update guard sees (and
measures) its vision tower's parameters like any other."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import AutoProcessor

from asyncrl.data.images import processor_inputs
from asyncrl.data.visual_task import draw_squares
from asyncrl.testing.tiny_vlm import IMAGE_TOKEN, VISION_TOKENS, build_tiny_vlm


def test_builds_deterministically_and_reuses(tiny_vlm, tmp_path):
    again = build_tiny_vlm(tmp_path / "m")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        a = hashlib.sha256((again / name).read_bytes()).hexdigest()
        b = hashlib.sha256((Path(tiny_vlm) / name).read_bytes()).hexdigest()
        assert a == b, name
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_vlm(again) == again and (again / "model.safetensors").stat().st_mtime_ns == mtime


def test_loads_with_processor_and_template(tiny_vlm):
    from transformers import LlavaForConditionalGeneration

    from asyncrl.models.loading import is_multimodal, load_causal_lm

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    tok = processor.tokenizer
    assert all(tok.convert_tokens_to_ids(t) != tok.unk_token_id and len(tok.tokenize(t)) == 1 for t in VISION_TOKENS)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert is_multimodal(tiny_vlm)
    model = load_causal_lm(tiny_vlm, torch.float32)
    assert isinstance(model, LlavaForConditionalGeneration)
    assert model.config.image_token_index == tok.convert_tokens_to_ids(IMAGE_TOKEN)


def test_update_guard_sees_the_vision_tower(tiny_vlm):
    from asyncrl.config import GuardConfig
    from asyncrl.models.loading import load_causal_lm
    from asyncrl.train.guard import UpdateGuard

    model = load_causal_lm(tiny_vlm, torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = UpdateGuard(model, opt, GuardConfig(max_update_ratio=1e9), grad_clip=1.0)
    vision = [p for n, p in model.named_parameters() if "vision_tower" in n]
    assert vision and all(any(p is q for q in guard.params) for p in vision)  # measured with the rest
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "vision_tower" in n}
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ids = torch.tensor([[1] + [image_id] * 16 + [5, 6, 7]])
    out = model(input_ids=ids, labels=ids, **processor_inputs(processor, [[draw_squares(2)]]))
    verdict = guard.step(out.loss, lr=0.1)
    assert verdict.accepted and verdict.update_ratio > 0
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_update_guard_rejects_and_undoes_an_oversized_vision_update(tiny_vlm):
    from asyncrl.config import GuardConfig
    from asyncrl.models.loading import load_causal_lm
    from asyncrl.train.guard import UpdateGuard

    model = load_causal_lm(tiny_vlm, torch.float32)
    for n, p in model.named_parameters():  # only the vision tower trains: the diff the guard sees is all its own
        p.requires_grad_("vision_tower" in n)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=10.0)
    guard = UpdateGuard(model, opt, GuardConfig(max_update_ratio=1e-3), grad_clip=None)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ids = torch.tensor([[1] + [image_id] * 16 + [5, 6, 7]])
    out = model(input_ids=ids, labels=ids, **processor_inputs(processor, [[draw_squares(3)]]))
    verdict = guard.step(out.loss, lr=10.0)
    assert not verdict.accepted and verdict.update_ratio > 1e-3
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # undone exactly
