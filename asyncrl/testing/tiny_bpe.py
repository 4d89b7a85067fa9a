"""A tiny Qwen2 chat model with a real byte-level BPE tokenizer and a chat template, built locally.

The character-level model of :mod:`asyncrl.testing.tiny_model` maps one character to one token and has no chat
template, so it cannot exercise what real models do: multi-token answers, token boundaries that are not
character boundaries, and prompts rendered with ``apply_chat_template``. This one looks like a Qwen2.5
instruct model at a tiny scale:

- the tokenizer is trained here with the ``tokenizers`` library (byte-level BPE, Qwen2's pre-tokenizer
  regex: digits split one by one) on text generated from a fixed seed: arithmetic, short chat
  conversations and sentences;
- special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), no bos, as in Qwen2.5;
- the chat template is Qwen's ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then
  ``<|im_start|>assistant\\n`` with ``add_generation_prompt=True``), without Qwen's default system prompt;
- the weights are initialised from ``seed``; head size 32 is one the vLLM CPU attention backend accepts.

The directory (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ...)
loads in HF transformers and vLLM like any model directory; nothing comes from a hub. The build is
deterministic (same seed, same files) and written under a temporary name, then renamed into place, so
concurrent builders never see half a model and a complete directory is reused as is.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from asyncrl.testing.tiny_model import TINY_CONFIG, save_model_dir

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_chat_model", "corpus"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's ChatML template without its default system prompt and tool calls."""
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer pattern (``tokenizer.json`` of Qwen2.5): numbers split into single digits."""
VOCAB_SIZE = 512
_WORDS = [
    "the", "a", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "what", "is", "plus",
    "minus", "times", "sum", "of", "and", "answer", "question", "please", "compute", "add", "numbers", "result",
    "equals", "give", "only", "final", "solve", "this", "problem", "count", "how", "many", "legs", "does", "cat",
    "dog", "bird", "have", "total", "value", "write", "your", "think", "step", "first", "then", "so", "we", "get",
    "it",
]


def corpus(n: int = 4000, *, seed: int = 0) -> list[str]:
    """Deterministic training text for the tokenizer: arithmetic, chat turns and sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."
        kind = rng.randrange(3)
        if kind == 0:
            out.append(f"{a}{op}{b}={value}")
        elif kind == 1:
            question = rng.choice([f"What is {a} {op} {b}?", f"Compute {a}{op}{b}.", sentence])
            out.append(f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{question}"
                       f"<|im_end|>\n<|im_start|>assistant\n{value}<|im_end|>\n")
        else:
            out.append(f"{sentence} {a} {op} {b} = {value}\n")
    return out


def _tokenizer(seed: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # special tokens are split off before training, as they are when encoding
    text = [piece for line in corpus(seed=seed) for piece in _without_specials(line)]
    tok.train_from_iterator(text, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )


def _without_specials(line: str) -> list[str]:
    for special in SPECIAL_TOKENS:
        line = line.replace(special, "\x00")
    return [piece for piece in line.split("\x00") if piece]


def _complete(path: Path) -> bool:
    return all((path / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json"))


def build_tiny_chat_model(path: str | os.PathLike, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Builds (or reuses) the tiny BPE chat model at ``path`` and returns the path.

    Args:
        path: the model directory; reused when complete (a partial one is rebuilt).
        seed: seeds the tokenizer's training text and the weights.
        dtype: the weights' dtype (float32, bfloat16, float16).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if _complete(path):
        return path
    tokenizer = _tokenizer(seed)
    if len(tokenizer) > VOCAB_SIZE:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's {VOCAB_SIZE=}")
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
        **TINY_CONFIG,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.bos_token_id = None
    return save_model_dir(path, model, tokenizer)


if __name__ == "__main__":  # the same as `asyncrl tiny-model DIR --chat`
    from asyncrl.testing.build import main

    main(prog="python -m asyncrl.testing.tiny_bpe", kind="chat")
