"""The tiny BPE chat model looks like a real one: byte-level BPE with multi-token numbers, a ChatML template,
Qwen2.5's special tokens, a deterministic build, and it loads in HF transformers and vLLM from its directory."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from asyncrl.testing.tiny_bpe import build_tiny_chat_model


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_build_is_deterministic_and_reused(tiny_chat_model, tmp_path):
    again = build_tiny_chat_model(tmp_path / "again")
    assert _digest(again) == _digest(Path(tiny_chat_model))
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_chat_model(again) == again and (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_tokenizer_is_bpe_with_a_chat_template(tiny_chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    assert tok.bos_token_id is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    words = tok("What is the answer", add_special_tokens=False).input_ids
    assert len(words) == 4, "whole words are single tokens (merges learnt)"
    assert len(tok(" 1234", add_special_tokens=False).input_ids) == 5, "digits split one by one, as in Qwen2"
    assert tok.decode(tok("héllo wörld 42", add_special_tokens=False).input_ids) == "héllo wörld 42"  # byte-level
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 3 and ids.count(end) == 2


def test_loads_and_generates_in_transformers(tiny_chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    assert model.config.model_type == "qwen2" and len(tok) <= model.config.vocab_size
    ids = torch.tensor([tok("1+1=", add_special_tokens=False).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 3
