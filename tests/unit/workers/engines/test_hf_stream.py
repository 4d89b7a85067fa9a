"""Tests for the HF engine's streaming path (workers.engines.hf_stream): continuous batching, the trainer's logprobs.

A streamed group must be what the trainer recomputes (``token_logprobs`` on the collated rollouts, fp32, 1e-5)
however its rows were admitted: left-padded into a running batch at different steps, with different prompt
lengths. A weight update in flight (``keep``) re-prefills the running rows, so each version span's logprobs are
the recomputation under that span's weights; ``abort`` returns the started requests and keeps the queued ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncrl.config import HFEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import token_logprobs
from asyncrl.weights.base import WeightUpdate
from tests.engine_utils import PROMPTS, SAMPLING, collate, load_model, max_logprob_diff, perturbed
from workers.engines import Completion, Finished, GenerationRequest, build_engine
from workers.engines.hf import HFEngine

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("hf_stream") / "tiny"))


def make_engine(model_dir: str, **overrides: Any) -> HFEngine:
    kw = dict(model=model_dir, seed=7, max_new_tokens=16, max_num_seqs=4, **SAMPLING)
    return build_engine(HFEngineConfig(**{**kw, **overrides}))


def request(i: int, n: int = 2, prompt: Any = None, **kw: Any) -> GenerationRequest:
    return GenerationRequest(epoch=0, prompt_index=i, prompt=PROMPTS[i % 3] if prompt is None else prompt, n=n, **kw)


def drain(engine: HFEngine, got: dict[int, Finished] | None = None) -> dict[int, Finished]:
    got = {} if got is None else got
    for _ in range(1000):
        if not engine.in_flight():
            return got
        for f in engine.poll(1.0):
            assert f.key not in got, f"key {f.key} returned twice"
            got[f.key] = f
    raise AssertionError(f"{engine.in_flight()} requests never finished")


def span_diffs(models: dict[int, torch.nn.Module], completions: list[list[Completion]]) -> dict[int, float]:
    """max |engine - trainer| logprob per version, each span recomputed under its own version's model."""
    batch = collate(completions)
    rows = [c for cs in completions for c in cs]
    out: dict[int, float] = {}
    for version, model in models.items():
        ours = token_logprobs(model, batch["input_ids"], batch["attention_mask"], **SAMPLING)
        for b, c in enumerate(rows):
            start = int(c.prompt_ids.numel())
            for v, s, e in c.version_spans or [(c.policy_version, 0, c.response_ids.numel())]:
                if v == version and e > s:
                    d = (ours[b, start + s : start + e] - c.logprobs[s:e]).abs().max().item()
                    out[version] = max(out.get(version, 0.0), d)
    return out


def assert_slot_time_adds_up(occ: dict[str, float]) -> None:
    """Available slot-time = busy + in-flight pause + free rows (queued/prefilling, or nothing queued)."""
    parts = occ["busy_seq_s"] + occ["pause_seq_s"] + occ["idle_queued_seq_s"] + occ["idle_empty_seq_s"]
    assert parts == pytest.approx(occ["capacity_seq_s"], rel=1e-6, abs=1e-6), occ


# ----------------------------------------------------------------------------------------------------------------------


def test_short_group_delivered_before_long_one_finishes(model_dir):
    engine = make_engine(model_dir, ignore_eos=True, max_new_tokens=24)
    assert engine.streaming
    engine.submit(1, request(1, max_new_tokens=24))
    engine.submit(2, request(2, max_new_tokens=3))
    first = []
    while not first:
        first = engine.poll(1.0)
    assert [f.key for f in first] == [2] and engine.in_flight() == 1
    assert [c.response_ids.numel() for c in first[0].completions] == [3, 3]
    rest = drain(engine)
    assert [c.response_ids.numel() for c in rest[1].completions] == [24, 24]
    occ = engine.occupancy()
    assert 0 < occ["busy_seq_s"] <= occ["capacity_seq_s"]
    # one request of 2 rows in 4 slots, then the other's 2 alone: free rows with nothing queued
    assert occ["idle_empty_seq_s"] > 0 and occ["pause_seq_s"] == 0
    assert_slot_time_adds_up(occ)


@pytest.mark.parametrize("lengths", ["natural", "long_tail"])
def test_logprobs_align_for_rows_admitted_at_different_steps(model_dir, lengths):
    """Five groups of different prompt lengths through a batch of 3 rows: rows join a running batch (left-padded
    to its length, or written right-aligned into a finished row's slot) at different steps; every token's logprob
    is the trainer's recomputation."""
    extra = dict(ignore_eos=True, length_tail=1.0, length_median=6) if lengths == "long_tail" else {}
    engine = make_engine(model_dir, max_num_seqs=3, **extra)
    long_prompt = {"prompt_ids": [1] + list(range(10, 40))}
    engine.submit(0, request(0))
    engine.poll(0.0)  # one step: group 0 is running when the others arrive
    for i, p in enumerate([None, None, long_prompt, {"prompt_ids": [1, 5]}], start=1):
        engine.submit(i, request(i, prompt=p))
    got = drain(engine)
    assert sorted(got) == [0, 1, 2, 3, 4] and all(f.error is None and not f.aborted for f in got.values())
    completions = [got[k].completions for k in sorted(got)]
    assert all(c.policy_version == 0 and c.version_spans == [] for cs in completions for c in cs)
    assert len({c.response_ids.numel() for cs in completions for c in cs}) > 1
    diff = max_logprob_diff(engine.model, completions, **SAMPLING)
    print(f"max |dlogp| streamed ({lengths}) = {diff:.3e}")
    assert diff <= TOL
    # both admission paths ran: into finished rows' slots in place, and appended (the 31-token prompt is wider)
    assert engine._stream.merges["in_place"] > 0 and engine._stream.merges["appended"] > 0, engine._stream.merges


def test_group_tokens_do_not_depend_on_batch_composition(model_dir):
    """Each sample samples from its own generator: the same request alone or among others gives the same tokens."""
    alone = make_engine(model_dir)
    alone.submit(5, request(1, n=3))
    a = drain(alone)[5].completions
    crowded = make_engine(model_dir)
    crowded.submit(0, request(0, n=3))
    crowded.poll(0.0)
    crowded.submit(5, request(1, n=3))
    b = drain(crowded)[5].completions
    assert [c.response_ids.tolist() for c in a] == [c.response_ids.tolist() for c in b]


def test_the_batched_inverse_cdf_draw_samples_each_rows_distribution():
    """The scheduler samples a whole batch in one pass (each row's own uniform against its CDF): over 4000 rows of
    one distribution the token frequencies match it, filtered-out tokens (top-k) are never drawn, and each reported
    logprob is the sampled token's under the processed distribution."""
    from types import SimpleNamespace

    from asyncrl.train.logprobs import sampling_logprobs
    from workers.engines.hf_stream import StreamScheduler, _Seq

    config = SimpleNamespace(temperature=0.7, top_k=4, top_p=1.0, max_num_seqs=None)
    engine = SimpleNamespace(config=config, device=torch.device("cpu"), stop_ids=[], _suppress=())
    scheduler = StreamScheduler(engine)
    rows = 4000
    seqs = [_Seq(request=None, sample=i, limit=100, target=None, generator=torch.Generator().manual_seed(i),
                 spans=[[0, 0, 0]]) for i in range(rows)]
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 3.0, -9.0, 1.5]).repeat(rows, 1)
    scheduler._sample(seqs, logits)
    logp = sampling_logprobs(logits[:1], temperature=0.7, top_k=4)[0]
    tokens = torch.tensor([s.tokens[0] for s in seqs])
    counts = torch.bincount(tokens, minlength=logits.shape[1]).double() / rows
    allowed = torch.isfinite(logp)
    assert int(allowed.sum()) == 4 and (counts[~allowed] == 0).all()
    assert (counts - logp.exp()).abs().max() < 0.03  # 4000 draws: ~0.008 standard error per token
    assert all(s.logprobs[0] == pytest.approx(float(logp[s.tokens[0]]), abs=1e-6) for s in seqs[:50])


def _update_in_flight(model_dir, mode):
    """3 groups of 2 rows through 4 slots (group 2 waits in the queue), a full update after 5 polls; checks the
    spans (the update splits each running row's; the queued group starts under v1) and returns what ran."""
    engine = make_engine(model_dir, ignore_eos=True, max_new_tokens=20, max_num_seqs=4)
    engine.weights_in_flight = mode
    v0 = load_model(model_dir)
    new_state = perturbed(v0)
    v1 = load_model(model_dir)
    v1.load_state_dict(new_state)
    for i in range(3):
        engine.submit(i, request(i, max_new_tokens=20))
    for _ in range(5):
        engine.poll(0.0)
    engine.apply_weights(WeightUpdate(version=1, mode="full", tensors=new_state))
    got = drain(engine)
    completions = [got[k].completions for k in range(3)]
    for c in completions[0] + completions[1]:
        (v_a, s_a, e_a), (v_b, s_b, e_b) = c.version_spans
        assert (v_a, s_a, v_b, e_b) == (0, 0, 1, 20) and e_a == s_b and 0 < s_b < 20 and c.policy_version == 0
    assert all(c.version_spans == [] and c.policy_version == 1 for c in completions[2])
    return engine, v0, v1, completions


def test_weight_update_in_flight_keep(model_dir):
    """keep: the running rows' cache is recomputed under the new weights; spans change at the update and each
    span's logprobs are the trainer's under that span's weights (no KV computed by the old weights leaks in)."""
    engine, v0, v1, completions = _update_in_flight(model_dir, "keep")
    diffs = span_diffs({0: v0, 1: v1}, completions)
    print(f"max |dlogp| per span: {diffs}")
    assert set(diffs) == {0, 1} and max(diffs.values()) <= TOL
    occ = engine.occupancy()  # the re-prefill held 4 running rows: the pause is its own share of the slot-time
    assert occ["pause_seq_s"] > 0 and occ["idle_queued_seq_s"] >= 0
    assert_slot_time_adds_up(occ)
    # the old weights do not explain the new spans: the update really changed what was sampled from
    assert span_diffs({1: v0}, completions)[1] > 1e-3


def test_weight_update_in_flight_keep_cache(model_dir):
    """keep_cache: no re-prefill (no pause); spans change at the update exactly as with keep; the old span is the
    old weights' to 1e-5, the new span the new weights' on the old weights' cache: not the trainer's recomputation
    under the new version (the documented approximation)."""
    engine, v0, v1, completions = _update_in_flight(model_dir, "keep_cache")
    assert span_diffs({0: v0}, completions)[0] <= TOL
    new_span = span_diffs({1: v1}, completions)[1]  # top-k: a token may even lie outside v1's top k (inf)
    print(f"new span max |dlogp| against v1's recomputation: {new_span:.2e}")
    assert new_span > TOL
    occ = engine.occupancy()
    assert occ["pause_seq_s"] == 0
    assert_slot_time_adds_up(occ)


def test_weight_update_in_flight_abort(model_dir):
    engine = make_engine(model_dir, ignore_eos=True, max_new_tokens=12, max_num_seqs=2)
    engine.weights_in_flight = "abort"
    v1_state = perturbed(load_model(model_dir), scale=0.2)
    for i in range(3):  # one group per slot pair: 0 runs, 1 and 2 wait
        engine.submit(i, request(i, max_new_tokens=12))
    engine.poll(0.0)
    engine.apply_weights(WeightUpdate(version=1, mode="full", tensors=v1_state))
    got = drain(engine)
    assert got[0].aborted and got[0].completions == [] and got[0].error is None
    for k in (1, 2):
        assert not got[k].aborted and all(c.policy_version == 1 and c.version_spans == [] for c in got[k].completions)
    engine.submit(0, request(0, max_new_tokens=12))  # the worker submits it again: wholly under version 1
    again = drain(engine)[0].completions
    assert [c.policy_version for c in again] == [1, 1]
    v1 = load_model(model_dir)
    v1.load_state_dict(v1_state)
    # 2 x TOL: these perturbed weights (scale 0.2) sharpen the logits, and fp32 rounding between a padded batch and
    # the trainer's recomputation reached 1.1e-5 on 1 of 8 engine seeds (4.8e-6 to 1.1e-5, either sampler)
    assert max_logprob_diff(v1, [again, got[1].completions, got[2].completions], **SAMPLING) <= 2 * TOL


def test_failing_request_fails_only_its_key(model_dir):
    engine = make_engine(model_dir, max_num_seqs=8)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit(9, request(0, prompt={"prompt_ids": []}))
    with pytest.raises(ValueError, match="image prompts"):
        engine.submit(8, request(0, prompt={"prompt_ids": [1, 5], "images": [b"\x89PNG"]}))
    engine.submit(0, request(0))
    engine.submit(1, request(1, prompt={"prompt_ids": [1, 5000]}))  # outside the vocabulary: its prefill raises
    engine.submit(2, request(2))
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit(2, request(2))
    got = drain(engine)
    assert sorted(got) == [0, 1, 2] and got[1].error is not None and got[1].completions == []
    assert got[0].error is None and got[2].error is None and len(got[0].completions) == len(got[2].completions) == 2
    assert max_logprob_diff(engine.model, [got[0].completions, got[2].completions], **SAMPLING) <= TOL


def test_lora_update_in_flight_keep(model_dir):
    from tests.engine_utils import lora_update

    engine = make_engine(model_dir, ignore_eos=True, max_new_tokens=12, lora_rank=4)
    update, merged = lora_update(model_dir, version=1)
    engine.submit(0, request(0, max_new_tokens=12))
    for _ in range(4):
        engine.poll(0.0)
    engine.apply_weights(update)
    completions = [drain(engine)[0].completions]
    assert all([v for v, _, _ in c.version_spans] == [0, 1] for c in completions[0])
    diffs = span_diffs({0: load_model(model_dir), 1: merged}, completions)
    assert set(diffs) == {0, 1} and max(diffs.values()) <= TOL


def test_streaming_worker_loop_on_hf_answers_every_lease_once_across_an_in_flight_update(model_dir):
    """The worker's streaming loop (workers/streaming.py, with the channel fakes of its unit tests) on this engine:
    each lease answered once, the update applied in flight, every rollout's spans and per-span logprobs right."""
    from asyncrl.rewards.legacy import fake_reward
    from asyncrl.rollout import Rollout
    from tests.unit.workers.test_streaming import StagedWeights, StreamSender, _lease
    from workers.worker import RolloutWorker

    engine = make_engine(model_dir, ignore_eos=True, max_new_tokens=12, max_num_seqs=8)
    v0 = load_model(model_dir)
    new_state = perturbed(v0, seed=3)
    v1 = load_model(model_dir)
    v1.load_state_dict(new_state)
    leases = [_lease(i, n=2, prompt={"prompt_ids": [1, 50 + i, 41]}) for i in range(4)]
    sender = StreamSender(leases)
    weights = StagedWeights(WeightUpdate(version=1, mode="full", tensors=new_state),
                            ready=lambda: engine._stream is not None and any(len(s.tokens) >= 2
                                                                              for s in engine._stream.rows))
    w = RolloutWorker("w0", engine, fake_reward, sender, max_batch=4, slots=4, streaming=True, weights=weights,
                      weights_in_flight="keep", catch_up_s=10.0)
    w.run()
    assert sorted(lid for lid, _ in sender.groups) == [x.lease_id for x in leases] and not sender.failed
    assert weights.committed == [1] and w.inflight_updates == 1 and engine.in_flight() == 0
    rollouts: list[Rollout] = [r for _, g in sender.groups for r in g.rollouts]
    assert all([v for v, _, _ in r.version_spans] == [0, 1] and r.policy_version == 0 for r in rollouts)
    completions = [[Completion(prompt_ids=r.prompt_ids, response_ids=r.response_ids, logprobs=r.logprobs,
                               finish_reason=r.finish_reason, policy_version=r.policy_version,
                               version_spans=list(r.version_spans)) for r in rollouts]]
    diffs = span_diffs({0: v0, 1: v1}, completions)
    assert set(diffs) == {0, 1} and max(diffs.values()) <= TOL
