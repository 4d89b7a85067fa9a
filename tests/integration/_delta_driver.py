"""Receiver process for test_weights_delta_processes: a zmq receiver with ``delta=True`` that stages and commits
each version it is told, printing one JSON line per event: ``ready``, ``staged`` (crc32 per tensor), ``committed``,
and ``stats`` (its counters: full/delta bytes, refusals) at the end.

    python _delta_driver.py ADDRESS RECEIVER_ID --versions 2,3
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib

from asyncrl.weights import setup_weight_receiver
from asyncrl.weights._staging import tensor_bytes


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("receiver_id")
    p.add_argument("--versions", required=True)
    args = p.parse_args()
    r = setup_weight_receiver("zmq", args.address, receiver_id=args.receiver_id, delta=True, timeout_s=30.0)
    r.start()
    emit(event="ready")
    for version in map(int, args.versions.split(",")):
        update = r.wait(version, 60.0)
        if update is None:
            emit(event="timeout", version=version, stats={k: v for k, v in r.stats().items() if k != "recent_failures"})
            return 1
        crcs = {name: zlib.crc32(tensor_bytes(t)) for name, t in update.tensors.items()}
        emit(event="staged", version=update.version, checksums=crcs)
        r.commit(update.version)
        emit(event="committed", version=update.version)
    keys = ("full_bytes", "delta_bytes", "buckets_full", "buckets_delta", "delta_refused", "failures")
    emit(event="stats", stats={k: r.stats().get(k, 0) for k in keys})
    r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
