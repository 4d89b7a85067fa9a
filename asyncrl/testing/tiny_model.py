"""A tiny Qwen2-architecture causal LM and a character-level tokenizer, built locally.

Nothing is downloaded: the config is written here, the tokenizer is built with the ``tokenizers``
library (one token per printable ASCII character plus ``<pad>``, ``<bos>``, ``<eos>``), the weights
are initialised from ``seed``, and both are saved with ``save_pretrained`` to a directory that HF
transformers and vLLM load the same way as any model directory (so any HF model directory works
in place of this one on a GPU machine). Head size 32 is one the vLLM CPU attention backend accepts.
"""

from __future__ import annotations

import os
import shutil
import string
from pathlib import Path
from typing import Any

__all__ = ["TINY_CONFIG", "build_tiny_model", "char_vocab", "save_model_dir"]

SPECIAL = ["<pad>", "<bos>", "<eos>"]
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)


def char_vocab() -> dict[str, int]:
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    return {tok: i for i, tok in enumerate([*SPECIAL, *chars])}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<pad>"
    )


def build_tiny_model(path: str | os.PathLike, *, seed: int = 0, vocab_size: int = 128, dtype: str = "float32") -> Path:
    """Builds (or reuses) the tiny model at ``path`` and returns the path.

    Reuse is keyed on the files being complete; a partially written directory is rebuilt. The
    directory is written under a temporary name and renamed into place, so concurrent builders
    (e.g. test workers) never see half a model.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return path
    tokenizer = _tokenizer()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"{vocab_size=} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
        **TINY_CONFIG,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    return save_model_dir(path, model, tokenizer)


def save_model_dir(path: Path, model: Any, *others: Any) -> Path:
    """Saves ``model`` (safetensors) and ``others`` (tokenizer, processor) with ``save_pretrained`` into a fresh
    sibling directory, then renames it to ``path``: a reader (another test process building the same model) never
    sees a half-written directory, and when two processes build it at once the first rename wins."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for other in others:
        other.save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":  # the same as `asyncrl tiny-model DIR`
    from asyncrl.testing.build import main

    main(prog="python -m asyncrl.testing.tiny_model", kind="base")
