"""Shared test set-up: no hub access, quiet logs, GPU/vLLM tests skip cleanly where unavailable, and the tiny
BPE chat model (``workers.tiny_bpe``) built once per session."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_vllm = pytest.mark.skip(reason="needs vllm importable")
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(skip_vllm)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """Directory of the tiny Qwen2 chat model with a byte-level BPE tokenizer and a ChatML template
    (``workers.tiny_bpe.build_tiny_chat_model``), built once per test session, deterministically."""
    from workers.tiny_bpe import build_tiny_chat_model

    return str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "model"))


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> str:
    """Directory of the tiny LLaVA vision-language model (CLIP tower + Qwen2 LM, the BPE tokenizer with vision
    tokens, a ``LlavaProcessor``: ``workers.tiny_vlm.build_tiny_vlm``), built once per test session."""
    from workers.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model"))
