"""``asyncrl tiny-model DIR [--chat | --vlm]``: build one of the tiny test models into a directory, locally.

Nothing is downloaded; the build is deterministic (same seed, same files) and a complete directory is reused. The
directory loads in HF transformers and vLLM like any model directory, so it stands in for a real model wherever
one is asked for (``model.path``, ``HFEngineConfig(model=...)``, ``asyncrl check --model``):

- default: :mod:`asyncrl.testing.tiny_model`, a 2-layer Qwen2 with a character tokenizer (the embedded arithmetic
  task's model, what ``make run`` trains);
- ``--chat``: :mod:`asyncrl.testing.tiny_bpe`, the same with a byte-level BPE tokenizer and ChatML's chat template
  (chat ``messages`` prompts, multi-token answers);
- ``--vlm``: :mod:`asyncrl.testing.tiny_vlm`, a tiny LLaVA vision-language model and its processor (image prompts).

Blocks while it builds (seconds: the BPE tokenizer is trained here).
"""

from __future__ import annotations

import argparse

__all__ = ["KINDS", "main"]

KINDS = ("base", "chat", "vlm")
"""What ``--chat`` / ``--vlm`` (or neither) build."""
DESCRIPTION = ("Build a tiny model directory here, nothing downloaded (a complete one is reused): a 2-layer Qwen2 with a "
               "character tokenizer (the default), with a byte-level BPE tokenizer and a chat template (--chat), or a "
               "tiny LLaVA vision-language model with its processor (--vlm). It loads in transformers and vLLM like "
               "any model directory: model.path, HFEngineConfig(model=...), asyncrl check --model.")


def build(path: str, kind: str = "base", *, seed: int = 0, dtype: str = "float32") -> str:
    """Builds (or reuses) the tiny model ``kind`` at ``path``; returns the directory."""
    if kind == "chat":
        from asyncrl.testing.tiny_bpe import build_tiny_chat_model as builder
    elif kind == "vlm":
        from asyncrl.testing.tiny_vlm import build_tiny_vlm as builder
    elif kind == "base":
        from asyncrl.testing.tiny_model import build_tiny_model as builder
    else:
        raise ValueError(f"{kind=} must be one of {KINDS}")
    return str(builder(path, seed=seed, dtype=dtype))


def main(argv: list[str] | None = None, *, prog: str = "asyncrl tiny-model", kind: str | None = None) -> int:
    """The command line; ``kind`` fixed by a module's own ``python -m`` entry point (then no --chat/--vlm)."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("path", metavar="DIR", help="the model directory to write (reused when complete)")
    if kind is None:
        which = parser.add_mutually_exclusive_group()
        which.add_argument("--chat", action="store_true", help="a BPE tokenizer and a chat template (ChatML)")
        which.add_argument("--vlm", action="store_true", help="a vision-language model (LLaVA) and its processor")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights (and the BPE tokenizer's text)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    kind = kind or ("chat" if args.chat else "vlm" if args.vlm else "base")
    print(build(args.path, kind, seed=args.seed, dtype=args.dtype))
    return 0
