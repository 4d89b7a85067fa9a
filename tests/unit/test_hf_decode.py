"""Tests for workers.engines._hf_decode: the HF engine's lean decode loop is ``generate``, bit for bit.

The engine's two paths (:meth:`HFEngine._sample_decode`, :meth:`HFEngine._sample_generate`) on the same inputs and
seed must return the same tokens and the same logprobs exactly (``torch.equal``), with and without warpers, padding,
stop tokens and a LoRA adapter; the engine must take the lean path for a text-only model and reproduce a call's
tokens from its seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncrl.config import EngineConfig
from workers.engines._hf_decode import decode, supports_decode, warpers
from workers.engines.base import GenerationRequest, build_engine
from workers.tiny_model import build_tiny_model
from tests.engine_utils import SAMPLING, lora_update

PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("hf_decode") / "tiny")
    return build_engine(EngineConfig(type="hf", model=str(path), seed=3, max_new_tokens=12, lora_rank=4, **PLAIN))


def _batch(engine, texts: list[str], n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.engines.hf import left_pad

    return left_pad([engine._prompt_ids({"text": t}) for t in texts for _ in range(n)], engine.pad_id)


def _configure(engine, **fields: Any) -> None:
    for k, v in {**PLAIN, "ignore_eos": False, **fields}.items():
        setattr(engine.config, k, v)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert a[0].shape == b[0].shape and torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])  # -inf (a stopped row's pad outside top-k) equals -inf


PADDED, UNPADDED = ["1+2=", "hello there", "x"], ["4+4="]


@pytest.mark.parametrize(("sampling", "texts", "ignore_eos"), [
    (PLAIN, PADDED, False), (SAMPLING, PADDED, True), (SAMPLING, UNPADDED, False), (PLAIN, UNPADDED, True),
], ids=["plain-padded-eos", "warped-padded-ignore_eos", "warped-unpadded-eos", "plain-unpadded-ignore_eos"])
def test_decode_is_generate_bit_for_bit(engine, sampling, texts, ignore_eos):
    _configure(engine, ignore_eos=ignore_eos, **sampling)
    ids, mask = _batch(engine, texts)
    _same(engine._sample_decode(ids, mask, 12, 11), engine._sample_generate(ids, mask, 12, 11))


def test_rows_stopping_early_end_the_loop_as_generate_does(engine):
    """Many stop tokens: rows stop at different steps (the rest take the pad), and the call ends before the limit."""
    _configure(engine, **SAMPLING)
    saved = engine.stop_ids, engine._stop_tensor
    engine.stop_ids = list(range(2, 90))
    engine._stop_tensor = torch.tensor(engine.stop_ids)
    try:
        ids, mask = _batch(engine, ["1+2=", "hello"], n=4)
        lean, ref = engine._sample_decode(ids, mask, 12, 5), engine._sample_generate(ids, mask, 12, 5)
    finally:
        engine.stop_ids, engine._stop_tensor = saved
    _same(lean, ref)
    assert lean[1].shape[1] < 12


def test_decode_is_generate_with_an_adapter_and_suppressed_tokens(engine):
    _configure(engine, **SAMPLING)
    update, _ = lora_update(engine.config.model, version=1)
    engine.apply_weights(update)
    assert supports_decode(engine.model)  # judged by the model peft wraps
    ids, mask = _batch(engine, ["1+2=", "hello there"])
    _same(engine._sample_decode(ids, mask, 12, 2), engine._sample_generate(ids, mask, 12, 2))
    engine._suppress = [5, 6, 7]
    try:
        _same(engine._sample_decode(ids, mask, 12, 2), engine._sample_generate(ids, mask, 12, 2))
    finally:
        engine._suppress = []


def test_the_engine_takes_the_lean_path_and_a_seed_replays(engine, monkeypatch):
    _configure(engine, **SAMPLING)
    monkeypatch.setattr(type(engine), "_sample_generate", lambda *a, **k: pytest.fail("took generate"))
    requests = [GenerationRequest(epoch=0, prompt_index=i, prompt={"text": t}, n=3)
                for i, t in enumerate(["1+1=", "x"])]
    engine._calls = 0
    first = engine.generate(requests)
    engine._calls = 0
    again = engine.generate(requests)
    for a, b in zip((c for cs in first for c in cs), (c for cs in again for c in cs)):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
        assert not a.logprobs.is_inference() and a.logprobs.dtype == torch.float32


def test_decode_refuses_bad_arguments_and_other_models(engine):
    ids, mask = _batch(engine, ["1+2="])
    gen = torch.Generator()
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        decode(engine.model, ids, mask, max_new_tokens=0, processors=[], stop_ids=None, pad_id=0, generator=gen)
    with pytest.raises(ValueError, match="attention_mask of shape"):
        decode(engine.model, ids, mask[:, 1:], max_new_tokens=2, processors=[], stop_ids=None, pad_id=0, generator=gen)
    assert not supports_decode(torch.nn.Linear(2, 2))
    assert [type(p).__name__ for p in warpers(temperature=0.5, top_k=3, top_p=0.9, suppress=[1])] == [
        "SuppressTokensLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert warpers(**PLAIN) == []


@pytest.mark.gpu
def test_decode_is_generate_on_cuda(engine):
    """On CUDA the engine's generator (Philox, seeded) must give the stream the forked, seeded device RNG gave."""
    cuda = build_engine(EngineConfig(type="hf", model=engine.config.model, seed=3, max_new_tokens=12, device="cuda",
                                     **SAMPLING))
    ids, mask = _batch(cuda, PADDED)
    ids, mask = ids.cuda(), mask.cuda()
    _same(cuda._sample_decode(ids, mask, 12, 4), cuda._sample_generate(ids, mask, 12, 4))
