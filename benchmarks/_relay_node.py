"""The workers of one simulated node (benchmarks/weight_fanout.py, tests/integration/test_weight_relay.py).

One process, one weight receiver per worker id, opened as ``run_worker`` opens it
(:func:`asyncrl.weights.start.open_weight_receiver`): behind the node's relay with ``--relay DIR``, else straight
from the broadcaster. Each worker loops like a worker's safe point: wait for a newer version, copy it into its own
tensors (the engine's load), commit. One JSON line per event on stdout:

* ``committed`` {worker, version, via: relay | direct, t: time.monotonic() after the commit, crc (``--crc``: crc32 of
  what the worker now holds)}
* ``path`` {worker, path}: relay, direct, both (whenever it changes; behind a relay)
* ``relay_bytes`` {worker, bytes}: bytes its relay receiver verified so far (while they grow)

    python -m benchmarks._relay_node --address ENDPOINT --ids w0,w1 [--relay DIR] [--delta] [--crc]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys
import threading
import time
import zlib

import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.weights._staging import tensor_bytes
from asyncrl.weights.start import open_weight_receiver

_print = threading.Lock()


def emit(**event) -> None:
    with _print:
        print(json.dumps(event), flush=True)


def crc(tensors: dict[str, torch.Tensor]) -> int:
    value = 0
    for name in sorted(tensors):
        value = zlib.crc32(name.encode(), value)
        value = zlib.crc32(tensor_bytes(tensors[name]), value)
    return value


def serve(receiver, worker: str, stop: threading.Event, with_crc: bool) -> None:
    held: dict[str, torch.Tensor] = {}
    while not stop.is_set():
        update = receiver.wait(-(2**62), timeout=0.2)
        if update is None:
            continue
        if held.keys() == update.tensors.keys():  # the engine's load, out of the views into its own tensors
            for name, t in update.tensors.items():
                held[name].copy_(t)
        else:
            held = {name: t.clone() for name, t in update.tensors.items()}
        before = receiver.stats().get("versions_via_relay", 0)
        receiver.commit(update.version)
        t = time.monotonic()
        via = "relay" if receiver.stats().get("versions_via_relay", 0) > before else "direct"
        emit(event="committed", worker=worker, version=update.version, via=via, t=t,
             **({"crc": crc(held)} if with_crc else {}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--relay", help="the node's relay directory (default: no relay, straight from the broadcaster)")
    p.add_argument("--address", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--delta", action="store_true")
    p.add_argument("--crc", action="store_true", help="report a crc32 of what each worker holds after each commit")
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    cfg = WeightSyncConfig(type="zmq", address=args.address, relay=args.relay, delta=args.delta)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    receivers = {w: open_weight_receiver(cfg, receiver_id=w) for w in args.ids.split(",")}
    threads = []
    for w, r in receivers.items():
        r.start()
        threads.append(threading.Thread(target=serve, args=(r, w, stop, args.crc), daemon=True))
        threads[-1].start()
    emit(event="started")
    paths = {w: None for w in receivers}
    progress = {w: 0 for w in receivers}
    while not stop.wait(0.02):
        for w, r in receivers.items():
            if args.relay is None:
                continue
            s = r.stats()
            if s["path"] != paths[w]:
                paths[w] = s["path"]
                emit(event="path", worker=w, path=s["path"])
            got = (s.get("relay") or {}).get("bytes_received", 0)
            if got > progress[w]:
                progress[w] = got
                emit(event="relay_bytes", worker=w, bytes=got)
    for r in receivers.values():
        r.close()


if __name__ == "__main__":
    main()
