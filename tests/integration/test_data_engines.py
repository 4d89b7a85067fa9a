"""One rendering everywhere: prompts of the ``data:`` section (chat turns through the tiny BPE chat model's template)
reach the HF and vLLM engines as token ids inside the lease payload, and the prompt tokens the trainer's batch
holds are exactly those the engines generated from; the engines' logprobs of multi-token BPE responses agree with
the trainer's forward."""

from __future__ import annotations

import json

import msgpack
import pytest

from asyncrl.config import DataConfig, HFEngineConfig, VllmEngineConfig
from asyncrl.data.prompts import load_prompts
from tests.engine_utils import SAMPLING, TOL, collate, load_model, max_logprob_diff
from workers.engines import GenerationRequest, build_engine

pytestmark = [pytest.mark.integration]

ROWS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 12*3."}],
     "answer": "36"},
    {"messages": [{"role": "user", "content": "How many legs does a cat have?"}], "answer": "4"},
]


@pytest.fixture(scope="module")
def prompts(tiny_chat_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return load_prompts(DataConfig(source="datasets", path=str(path)), tiny_chat_model)


def _check(engine, prompts, tiny_chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    wire = [msgpack.unpackb(msgpack.packb(p)) for p in prompts]  # the lease payload, as the worker decodes it
    out = engine.generate([GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=3) for i, p in enumerate(wire)])
    for item, row, completions in zip(prompts, ROWS, out):
        template = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        for c in completions:
            assert c.prompt_ids.tolist() == item["prompt_ids"]
            assert tok.decode(c.prompt_ids.tolist()) == template  # chat template included
    batch = collate(out)  # the trainer's view of the same groups
    for row_index, (item, completions) in enumerate((i, c) for i, cs in zip(prompts, out) for c in cs):
        n = int(batch["prompt_lengths"][row_index])
        assert batch["input_ids"][row_index, :n].tolist() == item["prompt_ids"]
        assert not batch["loss_mask"][row_index, :n].any()
    multi = [c for cs in out for c in cs if c.response_ids.numel() > 1]
    assert multi, "some responses have several BPE tokens"
    diff = max_logprob_diff(load_model(tiny_chat_model), out, **SAMPLING)
    assert diff <= TOL, f"engine vs trainer logprobs differ by {diff:.2e} on BPE responses"
    return diff


def test_hf_engine_generates_from_the_rendered_prompt(prompts, tiny_chat_model):
    engine = build_engine(HFEngineConfig(model=tiny_chat_model, seed=1, max_new_tokens=8, **SAMPLING))
    try:
        _check(engine, prompts, tiny_chat_model)
    finally:
        engine.close()


@pytest.mark.vllm
def test_vllm_engine_generates_from_the_rendered_prompt(prompts, tiny_chat_model):
    # in a process that has loaded numba first (the delta kernels warm up in every broadcaster/receiver with deltas):
    # vLLM's start-up scan of every module's namespace used to fail on llvmlite's lazy library object
    # ('_lib_fn_wrapper' object has no attribute 'get'); tests/unit/testing/test_tiny_bpe.py's vLLM test (extended) too
    from asyncrl.weights import _delta_kernels

    _delta_kernels.warm()
    engine = build_engine(VllmEngineConfig(model=tiny_chat_model, seed=1, max_new_tokens=8,
                                       max_model_len=256, **SAMPLING))
    try:
        assert engine.tokenizer.eos_token == "<|im_end|>"
        _check(engine, prompts, tiny_chat_model)
    finally:
        engine.close()
