"""The CURVE allow-list as data: authorize, revoke, the watched file (no socket: the wire is tested in
tests/integration/test_allow_list_runtime.py)."""

from __future__ import annotations

import collections

from asyncrl._zmq.curve import AllowList
from asyncrl.cluster.registry import write_allow_list
from asyncrl.transport.zmq import generate_curve_keys


def test_authorize_revoke_and_the_file(tmp_path):
    a, b, c = (generate_curve_keys()[0] for _ in range(3))
    counts: collections.Counter[str] = collections.Counter()
    path = tmp_path / "allowed"
    write_allow_list(path, [a])
    allow = AllowList([c], file=str(path), count=lambda name: counts.update([name]))
    assert allow.admits(a) and allow.admits(c) and not allow.admits(b)
    allow.authorize(b)
    assert allow.admits(b)
    v = allow.version
    allow.revoke(c)  # a fixed key revoked stays out
    assert not allow.admits(c) and allow.version > v
    write_allow_list(path, [])  # a left the file: refused once the owner re-reads it (its timer), the version moves
    v = allow.version
    assert allow.refresh() and not allow.admits(a) and allow.version > v
    write_allow_list(path, [a, c])  # the file names a again (admitted at once) but does not undo c's revocation
    assert allow.admits(a) and not allow.admits(c)
    allow.authorize(c)
    assert allow.admits(c) and allow.keys() == frozenset({a, b, c})
    assert counts["curve_keys_revoked"] == 1 and counts["curve_keys_authorized"] == 2
    assert allow.callback("*", b.encode()) and not allow.callback("*", generate_curve_keys()[0].encode())
    assert counts["curve_keys_admitted"] == 1 and counts["curve_keys_refused"] == 1


def test_an_unreadable_file_keeps_the_last_keys(tmp_path):
    a = generate_curve_keys()[0]
    path = tmp_path / "allowed"
    write_allow_list(path, [a])
    allow = AllowList(file=str(path))
    path.write_text("not a key\n")
    assert allow.admits(a)
    path.unlink()
    assert allow.admits(a)
