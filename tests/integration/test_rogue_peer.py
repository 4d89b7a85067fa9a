"""Bad input: fuzzed and malformed frames from a rogue peer never crash the pool; each is counted
and reported, and a healthy worker's epoch completes exactly once alongside it."""

from __future__ import annotations

import collections
import random
import time

import msgpack
import pytest
import torch
import zmq

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.codec import DecodeError, decode, encode
from asyncrl.rollout import Group, Rollout
from asyncrl.transport import protocol as P

pytestmark = pytest.mark.integration

NUM_PROMPTS = 60
MAX_MESSAGE_BYTES = 1 << 20


def _group(prompt_index: int, *, logprob: float = -0.5) -> Group:
    rollouts = [
        Rollout(
            epoch=0,
            prompt_index=prompt_index,
            sample_index=s,
            worker_id="rogue",
            policy_version=0,
            prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
            response_ids=torch.tensor([3, 4, 5], dtype=torch.int32),
            logprobs=torch.full((3,), logprob),
        )
        for s in range(2)
    ]
    return Group(epoch=0, prompt_index=prompt_index, rollouts=rollouts)


def _bad_messages(rng: random.Random) -> list[list[bytes]]:
    good = [bytes(f) for f in encode(P.GROUP, {"lease_id": 1, "group": _group(0).to_wire()})]
    msgs = [[rng.randbytes(rng.randint(0, 200))] for _ in range(40)]  # noise
    for _ in range(40):  # mutated valid header
        header = bytearray(good[0])
        for _ in range(rng.randint(1, 8)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        msgs.append([bytes(header), *good[1:]])
    nan_group = _group(1, logprob=float("nan")).to_wire()
    msgs += [
        [b""],
        [msgpack.packb(["arl", 99, P.GROUP, {}])],  # future schema version
        [msgpack.packb(["arl", 1, "launch_missiles", {}])],  # unknown kind
        [msgpack.packb(["arl", 1, P.HELLO, {"worker_id": "", "slots": -1}])],  # bad hello
        [msgpack.packb(["arl", 1, P.WELCOME, {}])],  # a pool-only kind from a worker
        encode(P.GROUP, {"lease_id": 2, "group": nan_group}),  # NaN logprobs
        [b"x" * (MAX_MESSAGE_BYTES // 2 + 10)] * 2,  # total over max_message_bytes
        good + [b"extra frame"],  # unreferenced frame
    ]
    return [[bytes(f) for f in m] for m in msgs]


def _is_bad(frames: list[bytes]) -> bool:
    """The pool's own verdict, computed locally: a few random mutations still decode to valid data."""
    try:
        kind, body = decode(frames, max_message_bytes=MAX_MESSAGE_BYTES)
        P.check_body(kind, body, P.WORKER_KINDS)
        if kind == P.GROUP:
            Group.from_wire(body["group"], group_size=2)
    except DecodeError:
        return True
    return False


def test_rogue_peer_is_counted_and_harmless():
    config = LoaderConfig(
        group_size=2,
        batch_size=4,
        capacity=16,
        num_workers=1,
        max_staleness=None,
        wait_timeout_s=60,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=5, max_message_bytes=MAX_MESSAGE_BYTES),
        worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=8, seconds_per_token=0.005)),
    )
    prompts = [{"prompt_ids": [i + 1]} for i in range(NUM_PROMPTS)]
    bad = _bad_messages(random.Random(0))
    expected_bad = sum(map(_is_bad, bad))
    assert expected_bad >= len(bad) - 10
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        with RolloutLoader(prompts, config) as loader:
            rogue.connect(loader.endpoint)
            it = iter(loader)
            consumed = list(next(it)["group_ids"])
            for frames in bad:
                rogue.send_multipart(frames)
            # a well-formed group for a prompt nobody leased to the rogue: refused (tests/integration/test_gate.py)
            rogue.send_multipart(encode(P.GROUP, {"lease_id": 10**9, "group": _group(NUM_PROMPTS - 1).to_wire()}))
            consumed += [g for batch in it for g in batch["group_ids"]]
            deadline = time.monotonic() + 5
            while loader.stats()["transport"].get("bad_messages", 0) < expected_bad and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = loader.stats()
    finally:
        rogue.close()
        ctx.term()
    counts = collections.Counter(consumed)
    assert set(counts) == {f"e0-p{i}" for i in range(NUM_PROMPTS)}
    assert max(counts.values()) == 1
    assert stats["transport"]["bad_messages"] == expected_bad
    assert stats["transport"]["not_leased_to_peer"] == 1
    assert len(stats["transport"]["recent_errors"]) > 0
    assert all(isinstance(e[1], str) and e[1] for e in stats["transport"]["recent_errors"])
