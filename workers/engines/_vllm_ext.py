"""vLLM worker extension (``worker_extension_cls``): runs inside vLLM's worker, in-process or not.

Full updates go through vLLM's native weight-transfer API to asyncrl's transfer engine
(:mod:`workers.engines._vllm_transfer`, registered when this module is imported, which in a vLLM worker process
happens before the model loads). The fallback here, :meth:`AsyncrlWorkerExtension.asyncrl_reload_weights`, takes
safetensors bytes, which survive vLLM's RPC serialization in every mode (tensors passed to ``collective_rpc``
arrive as plain lists in multiprocess mode), and loads them through ``reload_weights`` — ``model.load_weights``
alone breaks on CPU, whose backend prepacks linear weights.

Post-sync verification (:mod:`asyncrl.weights.verify`) reads the model runner's own parameters back
under the trainer's (HF) names: vLLM fuses ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into
``gate_up_proj``, so the fused tensor is sliced by the model config's head counts (q: heads × head_dim,
k and v: kv_heads × head_dim; gate and up: intermediate_size each) and each slice hashed on its own. On
CPU vLLM packs linear weights for its GEMM kernels and leaves ``layer.weight`` empty; such a weight is
read back through the layer's own kernel, ``cpu_linear(I, ...)`` with the identity (a product by 1 and
sums with 0: exact, so it is the weight the kernel really multiplies by; a ``-0.0`` element would read
back as ``+0.0``).
"""

from __future__ import annotations

from typing import Any

from workers.engines import _vllm_transfer

__all__ = ["AsyncrlWorkerExtension", "engine_param", "fused_slices"]

_vllm_transfer.register()  # a vLLM worker process imports this module (worker_extension_cls) before loading the model

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def fused_slices(config: Any) -> dict[str, list[int]]:
    """Output sizes of the shards of each fused projection, from an HF model config (tensor parallel size 1)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"qkv_proj": [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
            "gate_up_proj": [config.intermediate_size, config.intermediate_size]}


def engine_param(name: str, tied: bool) -> tuple[str, str | None, int | None]:
    """Where vLLM holds the trainer's (HF) tensor ``name``: ``(module path, fused projection or None, shard index)``,
    e.g. ``model.layers.0.self_attn.k_proj.weight`` -> ``("model.layers.0.self_attn.qkv_proj", "qkv_proj", 1)``;
    with tied embeddings ``lm_head`` is ``model.embed_tokens``. The parameter's own name is ``name``'s last part."""
    module_path, _, _ = name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    if leaf in _FUSED:
        fused, index = _FUSED[leaf]
        return f"{parent}.{fused}", fused, index
    if tied and module_path == "lm_head":
        return "model.embed_tokens", None, None
    return module_path, None, None


def _held_weight(module: Any, param_name: str) -> Any:
    """The parameter's values as the engine computes with them (packed CPU linear weights read back)."""
    import torch

    param = getattr(module, param_name)
    if param_name == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
        k = module.input_size_per_partition
        with torch.no_grad():
            return module.cpu_linear(torch.eye(k, dtype=param.dtype, device=param.device), param, None).t()
    if hasattr(module, "org_vocab_size"):  # embeddings and lm_head: rows past the vocabulary are padding
        return param.detach()[: module.org_vocab_size]
    return param.detach()


class AsyncrlWorkerExtension:
    def asyncrl_reload_weights(self, payload: bytes) -> int:
        """Loads a full HF-named state dict; returns the number of tensors loaded."""
        from safetensors.torch import load

        tensors = load(payload)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    def asyncrl_weight_checksums(self, names: list[str]) -> dict[str, Any]:
        """``[dtype, checksum]`` of what this worker holds under each HF name (``full`` mode); a name it does not
        hold is left out; with tensor parallelism (shards of a tensor) every name maps to None."""
        from asyncrl.weights.verify import tensor_checksum

        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            return {n: None for n in names}
        hf_config = vllm_config.model_config.hf_config
        sizes = fused_slices(hf_config)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        out: dict[str, Any] = {}
        cache: dict[str, Any] = {}
        for name in names:
            param_name = name.rpartition(".")[2]
            module_path, fused, index = engine_param(name, tied)
            key = f"{module_path}.{param_name}"
            if key not in cache:
                try:
                    cache[key] = _held_weight(model.get_submodule(module_path), param_name)
                except AttributeError:  # vLLM has no such tensor: left out, the worker reports it as a mismatch
                    cache[key] = None
            held = cache[key]
            if held is None:
                continue
            if index is not None:
                start = sum(sizes[fused][:index])
                held = held[start : start + sizes[fused][index]]
            out[name] = [str(held.dtype).removeprefix("torch."), tensor_checksum(held)]
        return out

    def asyncrl_param_specs(self) -> dict[str, Any]:
        """The model runner's own parameters as the engine computes with them (packed CPU weights read back):
        ``{"params": {vLLM name: [shape, dtype]}, "tied": [[names sharing storage]], "fused": True,
        "fused_slices": fused_slices(config), "tie_word_embeddings": bool}`` (``asyncrl check``'s structure stage)."""
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = vllm_config.model_config.hf_config
        params, by_storage = {}, {}
        for name, p in model.named_parameters(remove_duplicate=False):
            module_path, _, param_name = name.rpartition(".")
            held = _held_weight(model.get_submodule(module_path), param_name)
            params[name] = [list(held.shape), str(held.dtype).removeprefix("torch.")]
            by_storage.setdefault(p.data_ptr() if p.numel() else id(p), []).append(name)
        tied = [names for names in by_storage.values() if len(names) > 1]
        lm_head = getattr(model, "lm_head", None)
        embed = model.get_submodule("model.embed_tokens") if hasattr(model, "model") else None
        if lm_head is not None and lm_head is embed:  # vLLM ties by sharing the module: one parameter name
            tied.append(["lm_head.weight", "model.embed_tokens.weight"])
        return {"params": params, "tied": tied, "fused": True, "fused_slices": fused_slices(hf_config),
                "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False))}

    def asyncrl_lora_checksums(self, names: list[str], lora_id: int, scaling: float) -> dict[str, Any]:
        """``[dtype, checksum]`` of the LoRA adapter ``lora_id`` as vLLM computes with it, under peft names
        (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), read from the LoRA layers' stacked
        tensors at the adapter's slot in the LoRA manager (``lora_a_stacked[shard][slot, 0, :r]``): what the kernel
        multiplies by, whichever adapter that is. vLLM folds the scaling into ``lora_B`` when it loads an adapter
        (``LoRALayerWeights.optimize``); it is divided back out, exactly when ``scaling`` is a power of two (alpha 16
        over rank 4, 8, 16), else the ``lora_B`` names map to None (unverifiable). With the adapter in no slot
        (never loaded, or evicted) or a name whose module has no LoRA layer, the name is left out: a mismatch.
        With tensor parallelism (shards of each tensor) every name maps to None."""
        import math

        from asyncrl.weights.verify import tensor_checksum

        if self.vllm_config.parallel_config.tensor_parallel_size > 1:  # type: ignore[attr-defined]
            return {n: None for n in names}
        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        lora = manager._registered_adapters.get(lora_id)
        if lora is None or lora_id not in manager.lora_index_to_id:
            return {}
        slot = manager.lora_index_to_id.index(lora_id)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))  # type: ignore[attr-defined]
        exact = scaling > 0 and math.frexp(scaling)[0] == 0.5
        default_rank = next(iter(lora.loras.values())).rank if lora.loras else 0
        out: dict[str, Any] = {}
        for name in names:
            stem, sep, rest = name.removeprefix("base_model.model.").partition(".lora_")
            if not sep:
                continue
            which = rest.partition(".")[0]
            module_path, _, index = engine_param(f"{stem}.weight", tied)
            try:
                layer = model.get_submodule(module_path)
                stacked = (layer.lora_a_stacked if which == "A" else layer.lora_b_stacked)[index or 0]
            except AttributeError:  # no LoRA layer there: left out, a mismatch
                continue
            weights = lora.loras.get(module_path)
            rank = getattr(weights, "rank", None) or default_rank
            held = stacked[slot, 0]
            if which == "A":
                held = held[:rank]
            elif exact:
                held = held[:, :rank] / scaling
            else:
                out[name] = None
                continue
            out[name] = [str(held.dtype).removeprefix("torch."), tensor_checksum(held)]
        return out
