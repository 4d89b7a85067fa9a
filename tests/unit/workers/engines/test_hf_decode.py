"""Tests for workers.engines._hf_decode and its sampler workers.engines._sampling: the lean decode samples from the
distribution the trainer recomputes.

The lean loop's tokens are no longer ``generate``'s for the same seed (it draws by inverse CDF, one uniform per row,
not ``torch.multinomial``), so what must hold is: every sampled token's logprob is the trainer's teacher-forced
:func:`asyncrl.train.logprobs.token_logprobs` of it (within ``TOL``), with and without warpers, padding, stop tokens, a
LoRA adapter and suppressed tokens; tokens top-k/top-p/suppression removed are never drawn; the sampler's frequencies
match a fixed distribution (chi-square, fixed seed); a seed replays a call's tokens; the stop/pad rules are
``generate``'s (a stopped row takes the pad, the loop ends when every row has stopped).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from asyncrl.config import HFEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import token_logprobs
from tests.engine_utils import SAMPLING, TOL, lora_update, max_logprob_diff
from workers.engines import GenerationRequest, build_engine
from workers.engines._hf_decode import decode, supports_decode, warpers
from workers.engines._sampling import sample

PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("hf_decode") / "tiny")
    return build_engine(HFEngineConfig(model=str(path), seed=3, max_new_tokens=12, lora_rank=4, **PLAIN))


def _batch(engine, texts: list[str], n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.engines._rows import left_pad

    return left_pad([engine._prompt_ids({"text": t}) for t in texts for _ in range(n)], engine.pad_id)


def _configure(engine, **fields: Any) -> None:
    for k, v in {**PLAIN, "ignore_eos": False, **fields}.items():
        setattr(engine.config, k, v)


def _requests(texts: list[str], n: int = 3) -> list[GenerationRequest]:
    return [GenerationRequest(epoch=0, prompt_index=i, prompt={"text": t}, n=n) for i, t in enumerate(texts)]


def _aligned(engine, texts: list[str], sampling: dict[str, Any], **trainer: Any) -> list:
    """The engine's completions of ``texts`` (lean path), checked against the trainer's recomputation."""
    completions = engine.generate(_requests(texts))
    for c in (c for cs in completions for c in cs):
        assert torch.isfinite(c.logprobs).all() and (c.logprobs <= 0).all()  # never a token of probability 0
    diff = max_logprob_diff(engine.model, completions, **sampling, **trainer)
    print(f"max |engine - token_logprobs| ({sampling}) = {diff:.3e}")
    assert diff <= TOL
    return completions


PADDED, UNPADDED = ["1+2=", "hello there", "x"], ["4+4="]


@pytest.mark.parametrize(("sampling", "texts", "ignore_eos"), [
    (PLAIN, PADDED, False), (SAMPLING, PADDED, True), (SAMPLING, UNPADDED, False), (PLAIN, UNPADDED, True),
], ids=["plain-padded-eos", "warped-padded-ignore_eos", "warped-unpadded-eos", "plain-unpadded-ignore_eos"])
def test_decode_logprobs_are_the_trainers(engine, sampling, texts, ignore_eos, monkeypatch):
    monkeypatch.setattr(type(engine), "_sample_generate", lambda *a, **k: pytest.fail("took generate"))
    _configure(engine, ignore_eos=ignore_eos, **sampling)
    _aligned(engine, texts, sampling)


def test_tokens_outside_top_k_and_top_p_are_never_drawn(engine):
    """A narrow top-k / top-p: every token the engine drew has a finite trainer logprob (inside the kept set)."""
    for sampling in (dict(temperature=1.0, top_k=2, top_p=1.0), dict(temperature=1.5, top_k=0, top_p=0.3)):
        _configure(engine, ignore_eos=True, **sampling)
        _aligned(engine, PADDED, sampling)


def test_rows_stopping_early_take_the_pad_and_end_the_loop(engine):
    """Many stop tokens: rows stop at different steps (kept, then the pad until every row has stopped), and the call
    ends before the limit; a stopped row's pad logprob is that of the pad under the step's distribution."""
    _configure(engine, **SAMPLING)
    saved = engine.stop_ids, engine._stop_tensor
    engine.stop_ids = list(range(2, 90))
    engine._stop_tensor = torch.tensor(engine.stop_ids)
    try:
        ids, mask = _batch(engine, ["1+2=", "hello"], n=4)
        seqs, logprobs = engine._sample_decode(ids, mask, 12, 5)
    finally:
        engine.stop_ids, engine._stop_tensor = saved
    new = seqs[:, ids.shape[1]:]
    assert logprobs.shape == new.shape and new.shape[1] < 12
    stops = torch.isin(new, torch.tensor(list(range(2, 90))))
    assert stops.any(1).all()  # every row stopped (that is why the loop ended)
    first = stops.int().argmax(1)
    assert int(first.max()) == new.shape[1] - 1  # ... and the loop ended at the step the last one did
    for row, f in zip(new, first.tolist()):
        assert (row[f + 1:] == engine.pad_id).all()
    # the trainer's logprob of each row's tokens up to its stop, and of the pads after it (the pad's, not -inf)
    full = torch.cat([ids, new], dim=1)
    trainer = token_logprobs(engine.model, full, torch.cat([mask, torch.ones_like(new)], dim=1), **SAMPLING)
    ours = trainer[:, ids.shape[1]:]
    finite = torch.isfinite(ours) & torch.isfinite(logprobs)
    assert (ours[finite] - logprobs[finite]).abs().max() <= TOL
    assert torch.equal(torch.isfinite(ours), torch.isfinite(logprobs))


def test_an_adapter_and_suppressed_tokens(engine):
    _configure(engine, **SAMPLING)
    update, _ = lora_update(engine.config.model, version=1)
    engine.apply_weights(update)
    assert supports_decode(engine.model)  # judged by the model peft wraps
    _aligned(engine, ["1+2=", "hello there"], SAMPLING)
    engine._suppress = [5, 6, 7]
    try:
        completions = _aligned(engine, ["1+2=", "hello there"], SAMPLING, suppress_token_ids=[5, 6, 7])
    finally:
        engine._suppress = []
    assert not torch.isin(torch.cat([c.response_ids for cs in completions for c in cs]), torch.tensor([5, 6, 7])).any()


def test_the_engine_takes_the_lean_path_and_a_seed_replays(engine, monkeypatch):
    _configure(engine, **SAMPLING)
    monkeypatch.setattr(type(engine), "_sample_generate", lambda *a, **k: pytest.fail("took generate"))
    requests = _requests(["1+1=", "x"])
    engine._calls = 0
    first = engine.generate(requests)
    engine._calls = 0
    again = engine.generate(requests)
    other = engine.generate(requests)  # the next call's seed
    flat = [c for cs in first for c in cs]
    for a, b in zip(flat, (c for cs in again for c in cs)):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
        assert not a.logprobs.is_inference() and a.logprobs.dtype == torch.float32
    assert any(not torch.equal(a.response_ids, b.response_ids) for a, b in zip(flat, (c for cs in other for c in cs)))


# ----------------------------------------------------------------------------------------------------------------------
# the sampler


def _chi2_sf_6(x: float) -> float:
    """Survival function of the chi-square distribution with 6 degrees of freedom (closed form for even df)."""
    h = x / 2
    return math.exp(-h) * (1 + h + h * h / 2)


def test_sampler_frequencies_match_the_distribution():
    """200k draws (fixed seed: the statistic is a constant, the threshold only says how far from flaky it is) from
    7 tokens of positive probability among 10: a chi-square p-value far from 0, and the 3 of probability 0 never."""
    p = torch.tensor([0.0, 0.3, 0.05, 0.0, 0.2, 0.01, 0.14, 0.2, 0.0, 0.1])
    n = 200_000
    g = torch.Generator().manual_seed(0)
    tokens, logp = sample(p.log().expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=10).double()
    assert counts[p == 0].sum() == 0
    expected = n * p[p > 0].double()
    stat = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    print(f"chi2 = {stat:.2f} (6 df), p-value {_chi2_sf_6(stat):.3f}")
    assert _chi2_sf_6(stat) > 1e-4
    assert torch.equal(logp, p.log()[tokens])


def test_sampler_edges_never_land_on_a_zero_probability_token():
    """u = 0 takes the first token of positive probability, u just under 1 the last one, and so does ``u x total``
    rounded up to ``total`` (u = 1 here: the worst a rounding can give), never a token of probability 0 past it; a
    single kept token is always drawn."""
    logp = torch.tensor([[-math.inf, math.log(0.5), -math.inf, math.log(0.5), -math.inf, -math.inf]] * 4
                        + [[-math.inf] * 4 + [0.0, -math.inf]])
    top = math.nextafter(1.0, 0.0)
    u = torch.tensor([0.0, top, 0.5, 1.0, top], dtype=torch.float64)
    tokens, chosen = sample(logp, u)
    assert tokens.tolist() == [1, 3, 3, 3, 4] and torch.isfinite(chosen).all()


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
def test_decode_logprobs_are_the_trainers_on_cuda(engine):
    """On CUDA the generator (Philox, seeded) draws the uniforms on the device; the logprobs are the trainer's."""
    cuda = build_engine(HFEngineConfig(model=engine.config.model, seed=3, max_new_tokens=12, device="cuda",
                                     **SAMPLING))
    _aligned(cuda, PADDED, SAMPLING)
