"""Generation backends; heavy ones (vLLM, transformers) are imported only when built."""

from workers.engines.base import Completion, Engine, GenerationRequest, build_engine

__all__ = ["Completion", "Engine", "GenerationRequest", "build_engine"]
