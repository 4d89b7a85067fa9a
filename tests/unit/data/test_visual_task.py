"""The visual colour task (``asyncrl.data.visual_task.visual_colour_prompts``, ``data.source=visual_colour``): its
prompts are deterministic from the seed, each image holds exactly one square of the answer's colour on white, the
colours are all used, an unknown colour is refused; it loads through ``asyncrl.data.prompts`` with the tiny VLM's image
placeholders. Extended (not in CI): a short supervised run of the tiny VLM learns it well above chance (the probe
that showed the model's vision features reach its language model)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.data.images import decode_image
from asyncrl.data.visual_task import COLOUR_QUESTION, COLOURS, draw_square, visual_colour_prompts


def test_colour_prompts_are_deterministic_and_answers_are_right():
    items = visual_colour_prompts(40, seed=5)
    assert items == visual_colour_prompts(40, seed=5)
    assert items != visual_colour_prompts(40, seed=6)
    assert {it["answer"] for it in items} == set(COLOURS)
    for it in items:
        assert it["messages"] == [{"role": "user", "content": [{"type": "image"},
                                                               {"type": "text", "text": COLOUR_QUESTION}]}]
        pixels = np.asarray(decode_image(it["images"][0]).convert("RGB")).reshape(-1, 3)
        colours = {tuple(int(c) for c in p) for p in np.unique(pixels, axis=0)}
        assert colours == {(255, 255, 255), COLOURS[it["answer"]]}, it["answer"]
        side = int(np.sqrt((pixels != 255).any(-1).sum()))
        assert side * side == int((pixels != 255).any(-1).sum()) and 32 // 3 <= side <= 32 // 2


def test_draw_square_refuses_an_unknown_colour():
    with pytest.raises(ValueError, match="unknown colour 'purple'.*'blue'"):
        draw_square("purple")


def test_visual_colour_source_loads_with_image_placeholders(tiny_vlm):
    from asyncrl.config import DataConfig
    from asyncrl.data.prompts import load_prompts
    from asyncrl.models.loading import load_processor
    from asyncrl.testing.tiny_vlm import IMAGE_SIZE, IMAGE_TOKEN, PATCH_SIZE

    prompts = load_prompts(DataConfig(source="visual_colour", num_prompts=8, seed=1), tiny_vlm)
    pad = load_processor(tiny_vlm).tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert len(prompts) == 8
    for item, want in zip(prompts, visual_colour_prompts(8, seed=1)):
        assert item["answer"] == want["answer"] and item["images"] == want["images"]
        assert item["prompt_ids"].count(pad) == (IMAGE_SIZE // PATCH_SIZE) ** 2


@pytest.mark.extended
def test_tiny_vlm_learns_the_colour_task_with_supervision(tiny_vlm):
    """~7 s on a loaded 2-core machine (one thread; 90 s with torch's default threads there): 100 AdamW steps
    (lr 3e-3, batch 16) take the held-out first-token accuracy from chance (0.23 measured) to >= 0.9 (1.0 measured):
    the vision features reach the language model."""
    import torch

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster than several on a shared machine
    try:
        _learns(tiny_vlm)
    finally:
        torch.set_num_threads(threads)


def _learns(tiny_vlm: str) -> None:
    import torch

    from asyncrl.config import DataConfig
    from asyncrl.data.images import processor_inputs
    from asyncrl.data.prompts import load_prompts, sft_batch
    from asyncrl.models.loading import load_causal_lm, load_processor

    processor = load_processor(tiny_vlm)
    tok = processor.tokenizer
    train = load_prompts(DataConfig(source="visual_colour", num_prompts=512), tiny_vlm)
    held_out = list(load_prompts(DataConfig(source="visual_colour", num_prompts=64, seed=7), tiny_vlm))
    names = sorted(COLOURS)
    first = [tok(n, add_special_tokens=False).input_ids[0] for n in names]
    assert len(set(first)) == len(names)
    model = load_causal_lm(tiny_vlm, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def accuracy() -> float:
        with torch.no_grad():
            ids = torch.tensor([it["prompt_ids"] for it in held_out])
            logits = model(input_ids=ids, **processor_inputs(processor, [it["images"] for it in held_out])).logits
        pred = logits[:, -1, first].argmax(-1).tolist()
        return sum(names[p] == it["answer"] for p, it in zip(pred, held_out)) / len(held_out)

    before = accuracy()
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        idx = torch.randint(len(train), (16,), generator=gen).tolist()
        ids, labels = sft_batch([train[i] for i in idx], tok)
        pixels = processor_inputs(processor, [train[i]["images"] for i in idx])
        loss = model(input_ids=ids, labels=labels, **pixels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = accuracy()
    assert before < 0.5 and after >= 0.9, (before, after)
