"""The environment `make` sets up: every library the project is built on imports together."""

from __future__ import annotations


def test_public_surface():
    import asyncrl

    assert asyncrl.__all__ == sorted(asyncrl.__all__)
    for name in asyncrl.__all__:
        assert getattr(asyncrl, name) is not None
