"""vLLM worker extension (``worker_extension_cls``): runs inside vLLM's worker, in-process or not.

Weights arrive as safetensors bytes, which survive vLLM's RPC serialization in every mode (tensors
passed to ``collective_rpc`` arrive as plain lists in multiprocess mode), and are loaded through
``reload_weights`` — ``model.load_weights`` breaks on CPU, whose backend prepacks linear weights.
"""

from __future__ import annotations

__all__ = ["AsyncrlWorkerExtension"]


class AsyncrlWorkerExtension:
    def asyncrl_reload_weights(self, payload: bytes) -> int:
        """Loads a full HF-named state dict; returns the number of tensors loaded."""
        from safetensors.torch import load

        tensors = load(payload)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
