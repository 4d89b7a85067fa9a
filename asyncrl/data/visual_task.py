"""Synthetic visual tasks drawn with Pillow: "How many red squares?" over an image with 1-4 of them, and the easier
"What colour is the square?" over one filled square (red, green, blue or yellow; answer one word).

A prompt is ``{"messages": [user: image + question], "images": [PNG bytes], "answer": "3"}``: chat turns whose
``{"type": "image"}`` part the model's chat template renders as its image placeholder, the image as encoded bytes
(what travels in a lease), and the answer that :func:`asyncrl.rewards.arithmetic_reward` holds the response
to (1 for the exact digit). Squares are red on a white ground (optionally with blue distractors), never overlapping,
each :data:`SQUARE` px, at random cells of a grid that fits the image the tiny VLM's processor keeps
(``asyncrl.testing.tiny_vlm.IMAGE_SIZE``). Deterministic from ``seed``; PNG encoding is lossless, so the bytes are the
pixels.

The tiny VLM learns the colour task fast (held-out accuracy 0.23 -> 1.0 in 100 supervised steps, lr 3e-3, batch
16). The count is in its vision features from the start (a linear probe of the mean projected image tokens: 1.0),
but supervised learning first settles on the answer prior and leaves it only with lr 1e-3 and batch 32 (after ~150
steps; 1.0 held-out by 200); at lr 3e-3, or batch 16, it stayed at chance for 400-800 steps.
"""

from __future__ import annotations

import io
import random

__all__ = ["COLOURS", "COLOUR_QUESTION", "QUESTION", "draw_square", "draw_squares", "visual_colour_prompts",
           "visual_count_prompts"]

QUESTION = "How many red squares?"
SQUARE = 6
"""Side of a square, in pixels (a grid cell is 8 px: one vision patch of the tiny VLM)."""
RED, BLUE, WHITE = (230, 20, 20), (20, 40, 230), (255, 255, 255)
COLOUR_QUESTION = "What colour is the square?"
COLOURS = {"red": RED, "green": (20, 180, 40), "blue": BLUE, "yellow": (240, 220, 20)}
"""The colour task's answers (one word each) and the fills they name."""


def draw_squares(count: int, *, distractors: int = 0, size: int = 32, seed: int = 0) -> bytes:
    """PNG bytes of a ``size`` x ``size`` white image with ``count`` red and ``distractors`` blue squares."""
    from PIL import Image, ImageDraw

    cell = size // 4
    cells = [(x, y) for x in range(4) for y in range(4)]
    if count + distractors > len(cells):
        raise ValueError(f"{count=} + {distractors=} squares do not fit the {len(cells)} cells of a {size}px image")
    rng = random.Random(seed)
    picked = rng.sample(cells, count + distractors)
    image = Image.new("RGB", (size, size), WHITE)
    draw = ImageDraw.Draw(image)
    pad = (cell - SQUARE) // 2
    for i, (x, y) in enumerate(picked):
        x0, y0 = x * cell + pad, y * cell + pad
        draw.rectangle([x0, y0, x0 + SQUARE - 1, y0 + SQUARE - 1], fill=RED if i < count else BLUE)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def visual_count_prompts(n: int, *, seed: int = 0, max_count: int = 4, size: int = 32,
                         distractors: bool = False) -> list[dict]:
    """``n`` deterministic prompts (chat turns + one PNG) with their answers, counts uniform in 1..``max_count``;
    ``distractors``: 0-2 blue squares besides (a harder variant than the tiny VLM's CPU recipe learns)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        count = rng.randint(1, max_count)
        extra = rng.randint(0, 2) if distractors else 0
        png = draw_squares(count, distractors=extra, size=size, seed=rng.getrandbits(32))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        out.append({"messages": messages, "images": [png], "answer": str(count)})
    return out


def draw_square(colour: str, *, size: int = 32, seed: int = 0) -> bytes:
    """PNG bytes of a ``size`` x ``size`` white image with one filled square of ``colour`` (a :data:`COLOURS` key),
    its side ``size // 3`` to ``size // 2`` px, at a random position inside the image."""
    from PIL import Image, ImageDraw

    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; the task's colours are {sorted(COLOURS)}")
    rng = random.Random(seed)
    side = rng.randint(size // 3, size // 2)
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    image = Image.new("RGB", (size, size), WHITE)
    ImageDraw.Draw(image).rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=COLOURS[colour])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def visual_colour_prompts(n: int, *, seed: int = 0, size: int = 32) -> list[dict]:
    """``n`` deterministic prompts "What colour is the square?" (chat turns + one PNG of :func:`draw_square`) with
    their one-word answers, colours uniform over :data:`COLOURS` (chance: 1/4): the easier visual task, the one the
    tiny VLM learns on CPU."""
    rng = random.Random(seed)
    names = sorted(COLOURS)
    out = []
    for _ in range(n):
        colour = rng.choice(names)
        png = draw_square(colour, size=size, seed=rng.getrandbits(32))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": COLOUR_QUESTION}]}]
        out.append({"messages": messages, "images": [png], "answer": colour})
    return out
