"""The tiny BPE chat model in vLLM (whose engine starts processes)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


@pytest.mark.integration
@pytest.mark.vllm
@pytest.mark.extended  # make test: tests/integration/test_data_engines.py's vLLM test loads numba first the same way,
# then generates from this model and checks its logprobs (one vLLM start-up, ~20 s, instead of two)
def test_loads_and_generates_in_vllm(tiny_chat_model):
    """Also in a process that has loaded numba first (the delta kernels warm up in every broadcaster/receiver with
    deltas): vLLM's start-up scan of every module's namespace used to fail on llvmlite's lazy library object
    (``'_lib_fn_wrapper' object has no attribute 'get'``), depending on which tests ran before in the process."""
    from asyncrl.config import VllmEngineConfig
    from asyncrl.weights import _delta_kernels
    from workers.engines import GenerationRequest, build_engine

    _delta_kernels.warm()  # numba -> llvmlite.binding loaded, as after any delta broadcaster in this process
    engine = build_engine(VllmEngineConfig(model=tiny_chat_model, max_new_tokens=4, max_model_len=256))
    try:
        out = engine.generate([GenerationRequest(epoch=0, prompt_index=0, prompt={"prompt_ids": [1, 286, 201]}, n=2)])
        assert len(out[0]) == 2 and all(c.response_ids.numel() >= 1 for c in out[0])
        assert engine.tokenizer.eos_token == "<|im_end|>"
    finally:
        engine.close()
