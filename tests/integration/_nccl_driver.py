"""Receiver process for test_nccl_weights: joins the broadcaster's group, stages and commits the versions it is told.

Prints one JSON line per event on stdout: ``ready``, ``progress`` (bytes received while a version is in
flight), ``staged`` (with a crc32 per tensor), ``committed`` and, at the end, ``stats``. ``--delay`` sleeps
that long per received bucket (a slow member, so the test can kill it mid-transfer).

    python _nccl_driver.py ADDRESS RECEIVER_ID --versions 1,2 [--delay 0.02]
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

from asyncrl.weights import _collective
from asyncrl.weights._staging import tensor_bytes
from asyncrl.weights.nccl import NcclWeightReceiver


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("receiver_id")
    p.add_argument("--versions", required=True)
    p.add_argument("--delay", type=float, default=0.0)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1)  # a hung driver's stacks, on demand
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.delay:
        real = _collective.checksum

        def slow(buf):
            time.sleep(args.delay)
            return real(buf)

        _collective.checksum = slow
    r = NcclWeightReceiver(args.address, receiver_id=args.receiver_id, timeout_s=30, form_timeout_s=10, op_timeout_s=20)
    r.start()
    emit(event="ready")
    for version in map(int, args.versions.split(",")):
        last = None
        while (update := r.wait(version, 0.02)) is None:
            got = r.stats().get("bytes_received", 0)
            if got != last:
                emit(event="progress", version=version, bytes=got)
                last = got
        crcs = {name: zlib.crc32(tensor_bytes(t)) for name, t in update.tensors.items()}
        emit(event="staged", version=update.version, checksums=crcs, nbytes=update.nbytes)
        r.commit(update.version)
        emit(event="committed", version=update.version)
    stats = r.stats()
    emit(event="stats", failures=stats["failures"], generations_joined=stats.get("generations_joined", 0),
         recent_failures=[f["reason"] for f in stats["recent_failures"]])
    r.close()


if __name__ == "__main__":
    sys.exit(main())
