"""Receiver process for test_weights_processes: stages, checks and commits the versions it is told.

Prints one JSON line per event on stdout: ``ready``, ``progress`` (bytes received, while a version
is in flight), ``staged`` (with a crc32 per tensor) and ``committed``. ``--delay`` sleeps that long
per verified bucket (a slow receiver, so the test can kill it mid-transfer). ``--shadow`` gives the receiver an
engine's shadow weights (``{name: [dtype, shape]}`` as JSON: the engine tensors, zeros at first); a version
staged over the shadow is swapped into them and its crc32s are read from them (``via_shadow`` true).

    python _weights_driver.py BACKEND ADDRESS RECEIVER_ID --versions 1,2 [--window 1] [--delay 0.02] [--shadow JSON]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys
import time
import zlib

import torch

import asyncrl.weights.shm as shm_weights
import asyncrl.weights.zmq as zmq_weights
from asyncrl.weights import setup_weight_receiver
from asyncrl.weights._staging import tensor_bytes


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def slow_down(cls: type, method: str, delay: float) -> None:
    """Makes the receiver's per-bucket receive step sleep ``delay`` first (a slow receiver)."""
    real = getattr(cls, method)

    def slow(self, *args):
        time.sleep(delay)
        return real(self, *args)

    setattr(cls, method, slow)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("backend")
    p.add_argument("address")
    p.add_argument("receiver_id")
    p.add_argument("--versions", required=True)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--shadow", default=None)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1)  # a hung driver's stacks, on demand
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    emit(event="started")
    if args.delay:
        slow_down(zmq_weights.ZmqWeightReceiver, "_receive_bucket", args.delay)
        slow_down(shm_weights.ShmWeightReceiver, "_verify_bucket", args.delay)
        slow_down(shm_weights.ShmWeightReceiver, "_scatter_bucket", args.delay)
    kw = {"window": args.window, "timeout_s": 20.0} if args.backend == "zmq" else {}
    r = setup_weight_receiver(args.backend, args.address, receiver_id=args.receiver_id, **kw)
    shadow = live = None
    if args.shadow:
        from asyncrl.weights.shadow import ShadowWeights

        live = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (dtype, shape) in json.loads(args.shadow).items()}
        shadow = ShadowWeights(live)
        r.attach_shadow(shadow)
    r.start()
    emit(event="ready")
    for version in map(int, args.versions.split(",")):
        last = None
        while (update := r.wait(version, 0.02)) is None:
            got = r.stats().get("bytes_received", 0)
            if got != last:
                emit(event="progress", version=version, bytes=got)
                last = got
        via_shadow = shadow is not None and shadow.holds(update)
        held = update.tensors
        if via_shadow:
            shadow.swap_into(live, update)
            held = live
        crcs = {name: zlib.crc32(tensor_bytes(t)) for name, t in held.items()}
        emit(event="staged", version=update.version, checksums=crcs, nbytes=update.nbytes, via_shadow=via_shadow)
        r.commit(update.version)
        emit(event="committed", version=update.version)
    r.close()


if __name__ == "__main__":
    sys.exit(main())
