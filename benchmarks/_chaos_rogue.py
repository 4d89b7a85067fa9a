"""The chaos suite's rogue peer: hostile messages at a pool's endpoint until SIGTERM, counted by kind.

Kinds (one multipart message each, chosen at random by weight, at most ``--rate`` per second):

* ``garbage``: random bytes; ``malformed``: a valid GROUP header with random bytes changed, truncated or
  wrongly-typed msgpack, an unknown kind, a future protocol version;
* ``forged_*``: well-formed GROUPs for prompts never leased to the sender, every rollout's ``worker_id``
  starting with ``forged`` so the harness can spot one in a trained batch: ``forged_reward`` (1e39),
  ``forged_token_max`` (2**31-1), ``forged_token_neg`` (-5), ``forged_logprob`` (-1e30), ``forged_version``
  (policy_version 10**9), ``forged_sane`` (all in range, the live incarnation and version: only the
  ownership check stands in its way), sent from an identity that never said HELLO or from one that did
  (as ``forged-main``, slots 1: it records the prompts it is leased, never forges those, and says BYE at
  once so it sits on no lease);
* ``hello_storm``: HELLO reusing a real worker's id (``--steal-id``) every ``--storm-s``; when the pool
  welcomes it (the real worker was dead long enough) it counts a hijack and says BYE;
* ``ghost``: a fresh identity says HELLO and vanishes;
* ``oversized``: one frame above ``--max-message-bytes`` (the pool's socket drops the connection).

The DEALERs reconnect by themselves across trainer restarts (fixed port). They queue nothing while no
pool is connected (``ZMQ_IMMEDIATE``): a send that cannot be queued is not counted, so the count is of
messages handed to a live connection (a few may still die with a pool killed before reading them).
On SIGTERM it writes ``--out``: counts per kind, total, hijacks, the prompts ``forged-main`` was leased.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import time
from typing import Any

import msgpack
import torch
import zmq

from asyncrl.codec import DecodeError, decode, encode
from asyncrl.rollout import Group, Rollout
from asyncrl.transport import protocol as P

WEIGHTS = {"garbage": 30, "malformed": 30, "forged_reward": 3, "forged_token_max": 3, "forged_token_neg": 3,
           "forged_logprob": 3, "forged_version": 3, "forged_sane": 6, "hello_storm": 0, "ghost": 2, "oversized": 0.2}
"""Relative frequency of each kind (``hello_storm`` runs on its own clock)."""


class Rogue:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.ctx = zmq.Context()
        self.counts: collections.Counter[str] = collections.Counter()
        self.hijacks = 0
        self.leased: set[tuple[int, int]] = set()  # (epoch, prompt_index) ever leased to forged-main
        self.incarnation, self.version = "", 0  # the live pool's, learnt from its heartbeats
        self.anon = self._socket(b"rogue-anon")
        self.main = self._socket(b"rogue-main")
        self.storm = self._socket(b"rogue-storm")
        self.big = self._socket(b"rogue-big")
        self.main_hello_at = 0.0
        kinds = [k for k, w in WEIGHTS.items() if w > 0]
        self.kinds, self.weights = kinds, [WEIGHTS[k] for k in kinds]
        header = encode(P.GROUP, {"lease_id": 1, "group": self._group(0, "forged_sane").to_wire()})
        self.good_group = [bytes(f) for f in header]

    def _socket(self, identity: bytes) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, identity + b"-" + os.urandom(4).hex().encode())
        s.setsockopt(zmq.SNDHWM, 100)
        s.setsockopt(zmq.RCVHWM, 1000)
        s.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while no pool is up: only what reaches a pool counts
        s.connect(self.args.endpoint)
        return s

    def _hello(self, worker_id: str, slots: int = 1) -> list[bytes]:
        return [bytes(f) for f in encode(P.HELLO, {"worker_id": worker_id, "slots": slots, "pid": os.getpid(),
                                                   "host": "rogue", "protocol": P.PROTOCOL_VERSION})]

    def _group(self, prompt_index: int, kind: str) -> Group:
        prompt = torch.tensor([prompt_index % 250 + 1, 7, 9], dtype=torch.int32)
        response = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
        logprobs = torch.full((4,), -0.5)
        reward, version = 0.5, self.version
        if kind == "forged_reward":
            reward = 1e39
        elif kind == "forged_token_max":
            response = torch.tensor([11, 2**31 - 1, 13, 14], dtype=torch.int32)
        elif kind == "forged_token_neg":
            response = torch.tensor([11, -5, 13, 14], dtype=torch.int32)
        elif kind == "forged_logprob":
            logprobs = torch.tensor([-0.5, -1e30, -0.5, -0.5])
        elif kind == "forged_version":
            version = 10**9
        rollouts = [Rollout(epoch=0, prompt_index=prompt_index, sample_index=s, worker_id=f"forged-{kind}",
                            policy_version=version, incarnation=self.incarnation, prompt_ids=prompt,
                            response_ids=response, logprobs=logprobs, reward=reward)
                    for s in range(self.args.group_size)]
        return Group(epoch=0, prompt_index=prompt_index, rollouts=rollouts)

    def _send(self, sock: zmq.Socket, frames: list[bytes], kind: str) -> bool:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # no pool to queue it for (trainer down): not sent
            return False
        self.counts[kind] += 1
        return True

    def _drain(self, sock: zmq.Socket, who: str) -> None:
        while sock.poll(0):
            try:
                kind, body = decode(sock.recv_multipart(), max_message_bytes=1 << 26)
            except DecodeError:
                continue
            if kind == P.HEARTBEAT and isinstance(body.get("incarnation"), str):
                self.incarnation, self.version = body["incarnation"], int(body.get("policy_version", self.version))
            elif kind == P.LEASES:
                self.leased.update((int(x["epoch"]), int(x["prompt_index"])) for x in body.get("leases", []))
                self.version = int(body.get("policy_version", self.version))
                self._send(sock, [bytes(f) for f in encode(P.BYE, {})], "bye")  # sit on no lease
                if who == "main":
                    self.main_hello_at = time.monotonic() + 0.2
            elif kind == P.WELCOME and who == "storm":
                self.hijacks += 1
                self._send(sock, [bytes(f) for f in encode(P.BYE, {})], "bye")

    def one(self, kind: str) -> None:
        rng = self.rng
        if kind == "garbage":
            self._send(self.anon, [rng.randbytes(rng.randint(0, 300))], kind)
        elif kind == "malformed":
            choice = rng.randrange(5)
            if choice == 0:
                header = bytearray(self.good_group[0])
                for _ in range(rng.randint(1, 8)):
                    header[rng.randrange(len(header))] = rng.randrange(256)
                frames = [bytes(header), *self.good_group[1:]]
            elif choice == 1:
                frames = [self.good_group[0][: rng.randrange(1, len(self.good_group[0]))], *self.good_group[1:]]
            elif choice == 2:
                frames = [msgpack.packb(["arl", 1, P.GROUP, {"lease_id": "x", "group": []}])]
            elif choice == 3:
                frames = [msgpack.packb(["arl", 1, "launch_missiles", {}])]
            else:
                frames = [msgpack.packb(["arl", 99, P.GROUP, {}])]
            self._send(self.anon, frames, kind)
        elif kind.startswith("forged"):
            index = rng.randrange(self.args.prompts)
            if (0, index) in self.leased:
                return
            frames = [bytes(f) for f in encode(P.GROUP, {"lease_id": rng.randrange(1 << 30),
                                                         "group": self._group(index, kind).to_wire()})]
            if rng.random() < 0.5:
                self._send(self.anon, frames, kind)
            else:
                if time.monotonic() >= self.main_hello_at:
                    self._send(self.main, self._hello("forged-main"), "hello_main")
                    self.main_hello_at = time.monotonic() + 0.5
                self._send(self.main, frames, kind)
        elif kind == "ghost":
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 20)
            s.setsockopt(zmq.IDENTITY, b"ghost-" + os.urandom(6).hex().encode())
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.connect(self.args.endpoint)
            s.poll(200, zmq.POLLOUT)  # connected (or no pool up: then the send fails and is not counted)
            self._send(s, self._hello(f"ghost-{rng.randrange(1 << 30)}", slots=rng.choice([1, 4, 65536])), kind)
            s.close()
        elif kind == "oversized":
            self._send(self.big, [os.urandom(16) * ((self.args.max_message_bytes + 4096) // 16)], kind)

    def run(self, stop: list[bool]) -> None:
        period = 1.0 / self.args.rate
        next_storm = next_send = time.monotonic()
        while not stop[0]:
            now = time.monotonic()
            if self.args.storm_s > 0 and now >= next_storm:
                self._send(self.storm, self._hello(self.args.steal_id, slots=4), "hello_storm")
                next_storm = now + self.args.storm_s
            self._drain(self.main, "main")
            self._drain(self.storm, "storm")
            self._drain(self.anon, "anon")
            while self.big.poll(0):
                self.big.recv_multipart()
            if sum(self.counts.values()) >= self.args.frames:
                time.sleep(0.05)
                continue
            if now < next_send:
                time.sleep(min(next_send - now, 0.01))
                continue
            next_send = max(next_send + period, now - 1.0)
            self.one(self.rng.choices(self.kinds, self.weights)[0])

    def report(self) -> dict[str, Any]:
        hostile = {k: v for k, v in self.counts.items() if k not in ("bye", "hello_main")}
        return {"counts": dict(self.counts), "hostile_messages": sum(hostile.values()),
                "forged_groups": sum(v for k, v in hostile.items() if k.startswith("forged")),
                "hijacks": self.hijacks, "leased_to_rogue": sorted(self.leased)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--rate", type=float, default=500.0, help="hostile messages per second, at most")
    p.add_argument("--frames", type=int, default=10**9, help="stop sending after this many")
    p.add_argument("--steal-id", default="r0w-0", help="a real worker's id for the HELLO storm")
    p.add_argument("--storm-s", type=float, default=0.05, help="HELLO storm period (0: off)")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    rogue = Rogue(args)
    try:
        rogue.run(stop)
    finally:
        with open(args.out + ".tmp", "w") as f:
            json.dump(rogue.report(), f)
        os.replace(args.out + ".tmp", args.out)
        rogue.ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
