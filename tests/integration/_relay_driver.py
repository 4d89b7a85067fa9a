"""A relay process for test_weight_relay: ``python -m workers.relay``, slowed down where the test kills it.

``ASYNCRL_TEST_RELAY_SLOW`` (JSON) slows one version down and records its buckets in a file, so that the test can
SIGKILL the relay mid-transfer: ``{"version": 2, "where": "receive" | "fill", "delay": 0.05, "events": PATH,
"once": MARKER}``. ``receive``: each bucket of that version arriving from the broadcaster (upstream); ``fill``: each
bucket written into the node's segment (downstream). With ``once``, only the first relay process to start is slowed
(a replacement started by the supervisor is not). Everything else is the real relay.
"""

from __future__ import annotations

import json
import os
import sys
import time

import asyncrl.weights.shm as shm_weights
import asyncrl.weights.zmq as zmq_weights
from workers.relay import main


def _note(path: str, **event) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def slow_down(spec: dict) -> None:
    version, delay, events = spec["version"], spec["delay"], spec["events"]
    if spec["where"] == "receive":
        real_receive = zmq_weights.ZmqWeightReceiver._receive_bucket

        def receive(self, bucket, body, out):
            if body.get("version") == version:
                time.sleep(delay)
                _note(events, where="receive", version=version, index=bucket.index, pid=os.getpid())
            return real_receive(self, bucket, body, out)

        zmq_weights.ZmqWeightReceiver._receive_bucket = receive
        return
    real_publish, real_fill = shm_weights.ShmWeightBroadcaster._publish, shm_weights.ShmWeightBroadcaster._fill

    def publish(self, tensors, v, **kw):
        self._test_version = v
        return real_publish(self, tensors, v, **kw)

    def fill(self, bucket, tensors, out):
        checksum = real_fill(self, bucket, tensors, out)
        if getattr(self, "_test_version", None) == version:
            _note(events, where="fill", version=version, index=bucket.index, pid=os.getpid())
            time.sleep(delay)
        return checksum

    shm_weights.ShmWeightBroadcaster._publish = publish
    shm_weights.ShmWeightBroadcaster._fill = fill


if __name__ == "__main__":
    raw = os.environ.get("ASYNCRL_TEST_RELAY_SLOW")
    if raw:
        spec = json.loads(raw)
        marker = spec.get("once")
        if marker is None or not os.path.exists(marker):
            if marker is not None:
                open(marker, "w").close()
            slow_down(spec)
    sys.exit(main())
