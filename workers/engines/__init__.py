"""Generation backends inside a rollout worker, one module each, and the factory that picks one by ``engine.type``.

``base.py`` (the interface), ``fake.py``, ``hf.py`` (+ ``hf_stream.py``, its continuous batching), ``vllm_engine.py``
(+ ``vllm_stream.py``). The heavy libraries (transformers, vLLM) are imported when an engine is built, not here.
"""

from __future__ import annotations

from asyncrl.config import EngineConfig
from workers.engines.base import Completion, Engine, Finished, GenerationRequest, prompt_token_ids
from workers.engines.fake import FakeEngine
from workers.engines.hf import HFEngine
from workers.engines.vllm_engine import VLLMEngine

__all__ = ["Completion", "Engine", "Finished", "GenerationRequest", "build_engine", "prompt_token_ids"]

_ENGINES: dict[str, type[Engine]] = {"fake": FakeEngine, "hf": HFEngine, "vllm": VLLMEngine}


def build_engine(config: EngineConfig) -> Engine:
    """The engine for an engine config (:class:`~asyncrl.config.FakeEngineConfig`, ``HFEngineConfig`` or
    ``VllmEngineConfig``), by its ``type``.

    Raises:
        ValueError: an ``hf``/``vllm`` config without ``model``, or an unknown type.
    """
    if config.type in ("hf", "vllm") and not config.model:
        raise ValueError(f"engine.type={config.type!r} needs engine.model (a model directory)")
    if config.type not in _ENGINES:
        raise ValueError(f"unknown engine.type={config.type!r}; choose one of {sorted(_ENGINES)}")
    return _ENGINES[config.type](config)
