"""ZeroMQ machinery both channels share (private): ``io.py`` (the I/O thread every end owns, draining, what a
loopback bind is) and ``curve.py`` (CURVE keys and the ZAP allow-list). The rollout channel (``asyncrl.transport``)
and the weight channel (``asyncrl.weights``) import from here."""
