"""The workers of one simulated node for test_weight_relay: one process, one receiver per worker id.

Each worker opens its weight receiver as ``run_worker`` does (:func:`asyncrl.weights.start.open_weight_receiver`
with ``weights.relay``), and loops like a worker's safe point: wait for a newer version, copy it into its own
tensors (the engine's load), commit. One JSON line per event on stdout:

* ``committed`` {worker, version, via: relay | direct, crc: crc32 of what the worker now holds}
* ``path`` {worker, path}: relay, direct, both (whenever it changes)
* ``relay_bytes`` {worker, bytes}: bytes its relay receiver verified so far (while they grow)

    python _relay_workers_driver.py --relay DIR --address ENDPOINT --ids w0,w1 [--delta]
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


def serve(receiver, worker: str, stop: threading.Event) -> None:
    held: dict[str, torch.Tensor] = {}
    while not stop.is_set():
        update = receiver.wait(-(2**62), timeout=0.2)
        if update is None:
            continue
        held = {name: t.clone() for name, t in update.tensors.items()}  # the engine's load, out of the views
        before = receiver.stats()["versions_via_relay"]
        receiver.commit(update.version)
        via = "relay" if receiver.stats()["versions_via_relay"] > before else "direct"
        emit(event="committed", worker=worker, version=update.version, via=via, crc=crc(held))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--relay", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--delta", action="store_true")
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
        threads.append(threading.Thread(target=serve, args=(r, w, stop), daemon=True))
        threads[-1].start()
    emit(event="started")
    paths = {w: None for w in receivers}
    progress = {w: 0 for w in receivers}
    while not stop.wait(0.02):
        for w, r in receivers.items():
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
