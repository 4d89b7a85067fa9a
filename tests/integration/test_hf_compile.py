"""Tests for ``engine.compile``: the HF lean decode loop with its one-token step ``torch.compile``\\ d over a
``StaticCache`` (:class:`workers.engines._hf_decode.CompiledStep`).

What must hold: the compiled rollouts' logprobs are the trainer's :func:`asyncrl.train.logprobs.token_logprobs` (within
``TOL``; inductor fuses differently from eager), with left padding, dummy rows (a batch padded up to its row
bucket), stop tokens and pads; batches of other prompt widths in the same bucket compile nothing new; when
compiling fails the engine logs it once and decodes eagerly, the same tokens as an engine without ``compile``.
The compiling tests take ~5-30 s (inductor on a CPU) and are marked ``slow``; the fallback and bucket tests are quick.
"""

from __future__ import annotations

import logging

import pytest
import torch

from asyncrl.config import HFEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from tests.engine_utils import SAMPLING, TOL, max_logprob_diff
from workers.engines import GenerationRequest, _hf_decode, build_engine
from workers.engines._hf_decode import LENGTH_QUANTUM, MAX_SHAPES, CompiledStep

pytestmark = pytest.mark.integration  # torch.compile's inductor starts compile worker processes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("hf_compile") / "tiny"))


@pytest.fixture(scope="module")
def compiled(model_dir):
    """An engine compiled at start for 8 rows (``max_num_seqs``)."""
    return build_engine(HFEngineConfig(model=model_dir, seed=5, max_new_tokens=12, compile=True,
                                     max_num_seqs=8, **SAMPLING))


def _requests(texts: list[str], n: int) -> list[GenerationRequest]:
    return [GenerationRequest(epoch=0, prompt_index=i, prompt={"text": t}, n=n) for i, t in enumerate(texts)]


@pytest.mark.slow
def test_compiled_rollouts_align_with_the_trainer(compiled):
    """Warmed up at start; 3 prompts of different widths x 2 samples = 6 rows (2 dummies up to the bucket of 8),
    then a batch of other widths: the same bucket, nothing compiled again; logprobs the trainer's."""
    step = compiled._compiled
    assert step.failed is None and step.compiles == 1
    for texts in (["1+2=", "hello there", "x"], ["12+30=", "a b c d e f", "7"]):
        completions = compiled.generate(_requests(texts, n=2))
        assert all(torch.isfinite(c.logprobs).all() for cs in completions for c in cs)
        diff = max_logprob_diff(compiled.model, completions, **SAMPLING)
        print(f"compiled: max |engine - token_logprobs| = {diff:.3e}")
        assert diff <= TOL
    assert step.failed is None and step.compiles == 1


@pytest.mark.slow
def test_compiled_rows_stop_take_the_pad_and_end_the_loop(compiled):
    """Many stop tokens: rows stop at different steps, take the pad after, the call ends early; aligned."""
    saved = compiled.stop_ids, compiled._stop_tensor
    compiled.stop_ids = list(range(2, 90))
    compiled._stop_tensor = torch.tensor(compiled.stop_ids)
    try:
        completions = compiled.generate(_requests(["1+2=", "hello"], n=3))
        ids, mask = _batch(compiled, ["1+2=", "hello"], n=3)
        seqs, logprobs = compiled._sample_decode(ids, mask, 12, 11)
    finally:
        compiled.stop_ids, compiled._stop_tensor = saved
    new = seqs[:, ids.shape[1]:]
    stops = torch.isin(new, torch.tensor(list(range(2, 90))))
    assert new.shape[1] < 12 and stops.any(1).all()
    for row, f in zip(new, stops.int().argmax(1).tolist()):
        assert (row[f + 1:] == compiled.pad_id).all()
    assert {c.finish_reason for cs in completions for c in cs} == {"stop"}
    diff = max_logprob_diff(compiled.model, completions, **SAMPLING)
    print(f"compiled, stops: max |engine - token_logprobs| = {diff:.3e}")
    assert diff <= TOL
    assert compiled._compiled.failed is None


def _batch(engine, texts: list[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.engines._rows import left_pad

    return left_pad([engine._prompt_ids({"text": t}) for t in texts for _ in range(n)], engine.pad_id)


def test_a_failing_compile_falls_back_to_the_eager_loop_once(model_dir, monkeypatch, caplog):
    """No compiler (torch.compile's function raises): the call that hit it and every later one decode eagerly,
    the tokens an engine without ``compile`` gives for the same seed (the generator's state replayed), one warning,
    and torch.compile is not tried again."""
    calls = []

    def broken(model, **kwargs):
        calls.append(kwargs)

        def fn(**inputs):
            raise RuntimeError("no C++ compiler here")
        return fn

    monkeypatch.setattr(torch, "compile", broken)
    kw = dict(model=model_dir, seed=9, max_new_tokens=8, **SAMPLING)
    engine, plain = build_engine(HFEngineConfig(compile=True, **kw)), build_engine(HFEngineConfig(**kw))
    requests = _requests(["1+2=", "hello there"], n=3)
    with caplog.at_level(logging.WARNING, logger=_hf_decode.__name__):
        for _ in range(2):
            got, want = engine.generate(requests), plain.generate(requests)
            for a, b in zip((c for cs in got for c in cs), (c for cs in want for c in cs)):
                assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert "no C++ compiler here" in engine._compiled.failed and len(calls) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == _hf_decode.__name__]
    assert len(logged) == 1 and "decoding eagerly from now on" in logged[0] and "no C++ compiler here" in logged[0]


def test_buckets_bound_the_shapes_compiled(caplog):
    step = CompiledStep()
    assert step.shape(32, 12, 32) == (32, 64) and step.shape(30, 20, 32) == (32, 64)  # one bucket
    assert step.shape(5, 1, 8) == (8, LENGTH_QUANTUM) and step.shape(1, 1, 1) == (1, LENGTH_QUANTUM)
    assert step.shape(33, 40, 32) == (64, 96)
    for k in range(MAX_SHAPES - 4):
        assert step.shape(2, LENGTH_QUANTUM * (k + 3), 1) is not None
    with caplog.at_level(logging.WARNING, logger=_hf_decode.__name__):
        assert step.shape(2, 10_000, 1) is None and step.shape(3, 10_000, 1) is None  # eager, logged once
        assert step.shape(32, 12, 32) == (32, 64)  # a bucket it has still compiles (or has compiled)
    assert len([r for r in caplog.records if r.name == _hf_decode.__name__]) == 1
    step.fail(RuntimeError("x"))
    assert step.shape(32, 12, 32) is None
