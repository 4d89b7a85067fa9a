"""Shadow weights (``weights.shadow``): the shm receiver fills the engine's private copy during the transfer and the
engine swaps it in at commit.

What must hold: a swapped-in version is bit for bit the published one (ties kept, storage swapped, not copied); a
corrupted bucket, an abandoned or interrupted fill never reaches the engine and the next version still does; a
shadow held by a version the engine has (or is applying) is never written while a newer version arrives (that one
is staged as views); the HF engine applies a shadow update by swapping, post-sync verification reads its live
tensors after the swap, and the worker's fencing is unchanged.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config import FakeEngineConfig, HFEngineConfig
from asyncrl.weights import setup_weight_broadcaster, setup_weight_receiver
from asyncrl.weights._checksum import fill_bucket
from asyncrl.weights.base import WeightSyncError
from asyncrl.weights.shadow import ShadowWeights
from asyncrl.weights.shm import ShmWeightReceiver
from asyncrl.weights.verify import VerifyResult, WeightVerifier, tensor_checksum

WAIT_S = 20.0
KB = 1024


def weights(version: int) -> dict[str, torch.Tensor]:
    """8 tensors of 16 KiB (one bucket each at 16 KiB buckets), a tied pair, a bf16 and an empty one."""
    out = {f"w{i}": torch.full((4 * KB,), float(version * 100 + i)) for i in range(8)}
    emb = torch.arange(256, dtype=torch.float32).reshape(16, 16) + version
    return {**out, "embed.weight": emb, "head.weight": emb, "norm": torch.full((8,), version).bfloat16(),
            "empty": torch.zeros(0)}


def engine_tensors() -> dict[str, torch.Tensor]:
    """An engine's own tensors, laid out like ``weights`` (embed and head tied: one tensor under two names)."""
    emb = torch.zeros(16, 16)
    out = {f"w{i}": torch.zeros(4 * KB) for i in range(8)}
    return {**out, "embed.weight": emb, "head.weight": emb, "norm": torch.zeros(8, dtype=torch.bfloat16),
            "empty": torch.zeros(0)}


def strided(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values as views with other strides (a trainer's transposed or sliced tensors)."""
    return {k: torch.stack([t, t], -1)[..., 0] if t.numel() else t for k, t in state.items()}


def same(live: dict[str, torch.Tensor], version: int) -> bool:
    want = weights(version)
    return all(tensor_checksum(live[k]) == tensor_checksum(want[k]) for k in want)


def corrupt_checksum_of(b, bucket_index: int) -> None:
    """The next version ``b`` publishes stores a wrong checksum for one bucket: its bytes never verify. (Not a byte
    flipped after the write, as ``tests.weights_utils.corrupt_next`` does: a shadow receiver may have copied that
    byte before the flip, and then holds exactly what was published.)"""
    real = b._fill

    def fill(bucket, tensors, out):
        value = real(bucket, tensors, out)
        if bucket.index == bucket_index:
            b._fill = real
            return value ^ 1
        return value

    b._fill = fill


def until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def channel():
    """A shm broadcaster (16 KiB buckets) and a receiver filling the shadow of ``engine_tensors()``."""
    b = setup_weight_broadcaster("shm", bucket_bytes=16 * KB)
    live = engine_tensors()
    shadow = ShadowWeights(live)
    r = setup_weight_receiver("shm", b.address, receiver_id="r0")
    r.attach_shadow(shadow)
    r.start()
    yield b, r, live, shadow
    r.close()
    b.close()


def test_versions_are_swapped_in_bit_exact_with_ties_kept(channel):
    b, r, live, shadow = channel
    objects = {k: id(t) for k, t in live.items()}
    storages = set()
    for v in (1, 2, 3):
        b.publish(weights(v) if v < 3 else strided(weights(v)), v)  # v3: strided sources, the same bytes land
        update = r.wait(v, WAIT_S)
        assert update is not None and shadow.holds(update) and update.metadata["shadow_fill"] == v
        assert shadow.swap_into(live, update) and not shadow.swap_into(live, update)  # a re-apply changes nothing
        r.commit(v)
        assert same(live, v)
        assert live["embed.weight"] is live["head.weight"]  # still one tensor: the tie survived the swap
        assert {k: id(t) for k, t in live.items()} == objects  # the engine's objects stay; their storage moved
        storages.add(live["w0"].data_ptr())
    assert len(storages) == 2  # live and shadow storage alternate: swapped, never copied
    stats = r.stats()
    assert stats["versions_via_shadow"] == 3 and stats["held_updates"] == 0 and stats["failures"] == 0
    assert stats["shadow"] == {**stats["shadow"], "fills": 3, "swaps": 3, "state": "free"}
    # a restarted worker: a fresh engine and shadow, its receiver joining with version 3 already complete
    late_live = engine_tensors()
    late = ShadowWeights(late_live)
    r2 = setup_weight_receiver("shm", b.address, receiver_id="r0")
    r2.attach_shadow(late)
    r2.start()
    try:
        u3 = r2.wait(3, WAIT_S)
        assert late.holds(u3) and late.swap_into(late_live, u3) and same(late_live, 3)
    finally:
        r2.close()


def test_a_corrupted_bucket_is_never_swapped_in(channel):
    b, r, live, shadow = channel
    b.publish(weights(1), 1)
    u1 = r.wait(1, WAIT_S)
    shadow.swap_into(live, u1)
    r.commit(1)
    corrupt_checksum_of(b, 3)
    b.publish(weights(2), 2)
    until(lambda: r.stats().get("checksum_mismatches", 0) >= 1, "the mismatch")
    assert r.poll() is None and r.stats()["committed_version"] == 1
    assert "checksum mismatch in bucket 3 of version 2" in r.stats()["recent_failures"][0]["reason"]
    assert same(live, 1)  # the engine never saw a byte of version 2
    until(lambda: shadow.stats()["state"] == "free", "the aborted fill to free the shadow")
    assert shadow.stats()["aborted"] >= 1
    b.publish(weights(3), 3)  # the half-written shadow is simply refilled
    u3 = r.wait(3, WAIT_S)
    assert shadow.holds(u3) and shadow.swap_into(live, u3)
    r.commit(3)
    assert same(live, 3)


def test_a_held_shadow_is_not_written_while_the_next_version_arrives(channel):
    """Version 1 is handed to the engine (staged over the shadow) and not committed when 2 is published: 2 is staged
    as views and 1's bytes stay intact; once 2 is handed out, 1 is released and can no longer be swapped in."""
    b, r, live, shadow = channel
    b.publish(weights(1), 1)
    u1 = r.wait(1, WAIT_S)
    assert shadow.holds(u1)
    b.publish(weights(2), 2)
    until(lambda: r.stats()["versions_staged"] == 2, "version 2 to be staged")
    assert r.stats()["shadow_busy"] >= 1 and same(u1.tensors, 1)
    shadow.swap_into(live, u1)  # the engine applies 1 while 2 sits staged
    assert same(live, 1)
    u2 = r.wait(2, WAIT_S)
    assert u2.metadata.get("shadow") is None and not shadow.holds(u2)  # views into the shared slot
    with pytest.raises(ValueError, match="released"):
        shadow.swap_into(live, u1)  # 1 was released when 2 was handed out
    for k, t in u2.tensors.items():
        live[k].copy_(t)
    r.commit(2)
    assert same(live, 2)
    b.publish(weights(3), 3)
    u3 = r.wait(3, WAIT_S)
    assert shadow.holds(u3) and shadow.swap_into(live, u3)
    r.commit(3)
    assert same(live, 3)


def test_a_large_bucket_is_copied_while_it_is_written():
    """A tensor larger than a bucket is a bucket of its own: the receiver copies its first MiBs into the shadow while
    the broadcaster still writes the rest (the header's progress), and the result is bit for bit the published."""
    b = setup_weight_broadcaster("shm", bucket_bytes=16 * KB)
    big = {"big": torch.arange(8 << 20, dtype=torch.int32)}  # 32 MiB: one bucket, 32 pieces
    live = {"big": torch.zeros(8 << 20, dtype=torch.int32)}
    shadow = ShadowWeights(live)
    r2 = setup_weight_receiver("shm", b.address, receiver_id="r2")
    r2.attach_shadow(shadow)
    r2.start()

    def slow_fill(bucket, tensors, out):  # the trainer writes a piece every 10 ms
        report = b._progress
        return fill_bucket(bucket, tensors, out, lambda n: (report(n), time.sleep(0.01)))

    b._fill = slow_fill
    try:
        b.publish(big, 1)
        update = r2.wait(1, WAIT_S)
        assert update is not None and shadow.swap_into(live, update)
        assert torch.equal(live["big"], big["big"])
        assert 0 < r2.stats()["bytes_streamed"] <= 32 << 20, r2.stats()
    finally:
        r2.close()
        b.close()


def test_a_fill_overtaken_by_newer_versions_stages_only_the_newest(channel, monkeypatch):
    b, r, _, shadow = channel
    real = ShmWeightReceiver._scatter_bucket

    def slow(self, *args):
        time.sleep(0.03)
        return real(self, *args)

    monkeypatch.setattr(ShmWeightReceiver, "_scatter_bucket", slow)
    b.publish(weights(1), 1)
    until(lambda: r.stats().get("bytes_received", 0) > 0, "the fill of version 1 to start")
    b.publish(weights(2), 2)
    b.publish(weights(3), 3)
    update = r.wait(3, WAIT_S)
    assert update is not None and update.version == 3 and shadow.holds(update)
    assert same(update.tensors, 3)
    assert r.stats()["abandoned"] >= 1 and shadow.stats()["aborted"] >= 1


def test_closing_the_receiver_mid_fill_frees_the_shadow_and_leaves_the_engine(channel, monkeypatch):
    b, r, live, shadow = channel
    real = ShmWeightReceiver._scatter_bucket
    monkeypatch.setattr(ShmWeightReceiver, "_scatter_bucket", lambda self, *a: (time.sleep(0.05), real(self, *a))[1])
    b.publish(weights(1), 1)
    until(lambda: r.stats().get("bytes_received", 0) > 0, "the fill to start")
    r.close()
    assert shadow.stats()["state"] == "free" and r.stats()["versions_staged"] == 0
    assert all(not t.any() for t in live.values())  # nothing reached the engine


def test_a_receiver_dying_between_swap_and_commit_leaves_the_swapped_version(channel):
    """The I/O thread dies after the engine swapped version 1 in, before the worker commits it: the commit still
    records it and frees the shadow (nothing holds it), the engine keeps version 1, and the next poll raises."""
    b, r, live, shadow = channel
    b.publish(weights(1), 1)
    u1 = r.wait(1, WAIT_S)
    assert shadow.swap_into(live, u1)
    r._staging.die(RuntimeError("weight I/O thread died"))
    r.commit(1)
    assert same(live, 1) and shadow.stats()["state"] == "free" and r.stats()["held_updates"] == 0
    with pytest.raises(WeightSyncError, match="died"):
        r.poll()


def test_versions_the_shadow_cannot_take_go_through_views(channel):
    b, r, _, shadow = channel
    other = {k: (t.double() if k == "w0" else t) for k, t in weights(1).items()}
    b.publish(other, 1)
    u1 = r.wait(1, WAIT_S)
    assert not shadow.holds(u1) and r.stats()["shadow_mismatch"] == 1
    assert "w0 is float64[4096], the engine holds float32[4096]" in r.stats()["shadow_refused"]
    r.commit(1)
    b.publish({"a.lora_A.weight": torch.ones(4, 4)}, 2, mode="lora", lora_config={"r": 4})
    u2 = r.wait(2, WAIT_S)  # adapters are small: the usual path, not a mismatch
    assert u2.mode == "lora" and not shadow.holds(u2) and r.stats()["shadow_mismatch"] == 1
    assert shadow.stats()["fills"] == 0


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The tiny model with its output head tied to the embedding (one parameter under two state dict names)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from asyncrl.testing.tiny_model import build_tiny_model, save_model_dir

    root = tmp_path_factory.mktemp("shadow")
    base = build_tiny_model(root / "base")
    config = Qwen2Config.from_pretrained(base)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return str(save_model_dir(root / "tied", Qwen2ForCausalLM(config), AutoTokenizer.from_pretrained(base)))


def test_hf_engine_swaps_the_shadow_in_at_the_workers_safe_point(tied_model_dir):
    """The worker's own apply path: the HF engine swaps (ties kept), post-sync verification reads the live tensors
    after the swap (full check), the engine's outputs are the published weights' and carry their version."""
    from tests.engine_utils import load_model, perturbed
    from workers.engines.base import GenerationRequest
    from workers.engines.hf import HFEngine
    from workers.worker import RolloutWorker

    engine = HFEngine(HFEngineConfig(model=tied_model_dir, max_new_tokens=4))
    model = engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    up = model.model.layers[0].mlp.up_proj.weight
    up.data = up.data.t().contiguous().t()  # strided live storage: shadow_weights() makes it contiguous
    reference = load_model(tied_model_dir)
    b = setup_weight_broadcaster("shm", bucket_bytes=64 * KB)
    r = setup_weight_receiver("shm", b.address, receiver_id="hf")
    r.attach_shadow(engine.shadow_weights())
    assert up.is_contiguous()
    r.start()
    verifier = WeightVerifier("full")
    worker = RolloutWorker("w0", engine, lambda *a, **k: [0.0], None, max_batch=1, weights=r, verifier=verifier)
    worker.sender = SimpleNamespace(status={})  # what the worker's heartbeats would carry
    ids = torch.tensor([[1, 40, 41, 42]])
    try:
        for v in (1, 2):
            state = perturbed(reference, scale=0.1, seed=v)
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # the trainer's model is tied too
            b.publish(state, v)
            assert r.wait(v, WAIT_S) is not None
            ptr = model.lm_head.weight.data_ptr()
            assert worker.apply_staged_weights()
            assert model.lm_head.weight.data_ptr() != ptr  # swapped, not copied
            assert model.lm_head.weight is model.model.embed_tokens.weight
            assert verifier.last.ok and verifier.last.kind == "full" and len(verifier.last.checked) == len(state)
            reference.load_state_dict(state)
            with torch.no_grad():
                assert torch.equal(model(ids).logits, reference(ids).logits)
            (completion,) = engine.generate([GenerationRequest(epoch=0, prompt_index=0, prompt={"prompt_ids": [1, 40]}, n=1)])[0]
            assert completion.policy_version == v and engine.policy_version == v == r.committed_version
        assert r.stats()["versions_via_shadow"] == 2 and r.stats()["shadow"]["swaps"] == 2
        assert worker.sender.status["weights_via_shadow"] == 2 and worker.sender.status["shadow_busy"] == 0
    finally:
        r.close()
        b.close()
        engine.close()


def test_hf_streaming_engine_swaps_in_flight_and_each_span_matches_its_weights(tied_model_dir):
    """An in-flight update (streaming, ``keep``) applied by swapping the shadow: the running rows' spans change at
    the update and each span's logprobs are the trainer's under that span's weights."""
    from tests.engine_utils import SAMPLING, load_model, perturbed
    from tests.unit.workers.engines.test_hf_stream import TOL, drain, request, span_diffs
    from workers.engines.hf import HFEngine

    engine = HFEngine(HFEngineConfig(model=tied_model_dir, seed=7, max_new_tokens=20, max_num_seqs=4,
                                   ignore_eos=True, **SAMPLING))
    v0, v1 = load_model(tied_model_dir), load_model(tied_model_dir)
    state = perturbed(v0)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    v1.load_state_dict(state)
    b = setup_weight_broadcaster("shm", bucket_bytes=64 * KB)
    r = setup_weight_receiver("shm", b.address, receiver_id="hf-stream")
    r.attach_shadow(engine.shadow_weights())
    r.start()
    try:
        b.publish(state, 1)
        update = r.wait(1, WAIT_S)
        assert update is not None and engine.shadow_weights().holds(update)
        for i in range(2):
            engine.submit(i, request(i, max_new_tokens=20))
        for _ in range(5):
            engine.poll(0.0)
        engine.apply_weights(update)  # between two polls: the worker's safe point
        r.commit(1)
        got = drain(engine)
        completions = [got[k].completions for k in range(2)]
        assert all([v for v, _, _ in c.version_spans] == [0, 1] for cs in completions for c in cs)
        diffs = span_diffs({0: v0, 1: v1}, completions)
        assert set(diffs) == {0, 1} and max(diffs.values()) <= TOL, diffs
        assert span_diffs({1: v0}, completions)[1] > 1e-3  # the swap really changed what was sampled from
        assert r.stats()["shadow"]["swaps"] == 1
    finally:
        r.close()
        b.close()
        engine.close()


def test_a_shadow_workers_largest_status_fits_the_pools_limit():
    """``weights_via_shadow`` and ``shadow_busy`` are two more heartbeat keys; the pool drops a status over
    ``MAX_STATUS_KEYS`` whole (policy_version with it; counted as statuses_refused), so the largest one -
    streaming, in-flight pauses, verifying, after a mismatch - must still fit, with a key to spare (shm sends no wire-byte keys)."""
    from asyncrl.pool.admission import MAX_STATUS_KEYS
    from workers.engines.fake import FakeEngine
    from workers.worker import RolloutWorker

    class Receiver:  # shm: no wire bytes counted
        def stats(self):
            return {"failures": 0, "shadow_busy": 1, "shadow_mismatch": 2, "shadow": {"swaps": 3, "busy": 1}}

    verifier = WeightVerifier("full")
    verifier.last_mismatch = VerifyResult(version=2, kind="full", checked=["w0"], mismatched=["w0"], unverifiable=[])
    engine = FakeEngine(FakeEngineConfig())
    engine.occupancy = lambda: {"busy_seq_s": 1.0, "capacity_seq_s": 2.0,  # the HF streaming engine's split too
                                "idle_queued_seq_s": 0.1, "idle_empty_seq_s": 0.2, "pause_seq_s": 0.05}
    worker = RolloutWorker("w0", engine, lambda *a, **k: [0.0], SimpleNamespace(status={}),
                           max_batch=2, slots=2, streaming=True, weights=Receiver(), verifier=verifier)
    worker.inflight_pauses.append(0.01)
    worker.report()
    status = worker.sender.status
    assert status["weights_via_shadow"] == 3 and status["shadow_busy"] == 1 and "weight_full_bytes" not in status
    assert status["shadow_mismatch"] == 2
    assert "weight_mismatch_tensors" in status and "inflight_pause_p99_s" in status and "capacity_seq_s" in status
    assert "idle_no_lease_seq_s" in status and "pause_seq_s" in status
    assert len(status) < MAX_STATUS_KEYS, sorted(status)
    worker.weights = SimpleNamespace(stats=lambda: {"failures": 0, "full_bytes": 1, "delta_bytes": 2})  # zmq + delta
    worker.report()
    assert len(worker.sender.status) < MAX_STATUS_KEYS, sorted(worker.sender.status)
