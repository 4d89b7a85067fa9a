"""The pool: the versioned, bounded, exactly-once buffer between rollout workers and one trainer rank, and every rule
that decides what enters it and when it leaves.

::

    buffer.py     RolloutPool: leases, buffered groups, consumed watermark; the state a checkpoint holds
    ledger.py     PromptLedger: where every prompt of this rank's shard of the epoch is (LEASED -> ... -> CONSUMED)
    admission.py  the credit/admission policy the rollout channel applies per worker (no sockets)
    gate.py       the value ranges a decoded group must respect to be admitted
    poison.py     prompts every worker fails on: backoff, then raise or skip
    timeline.py   which (incarnation, policy_version) pairs name weights the trainer really had
    staleness.py  the one definition of staleness

The torchdata node over the pool is ``datapipes/pool_node.py``; the sockets that feed it are
``asyncrl/transport/zmq.py``. Import from the modules (``asyncrl.pool.buffer``, ...); the public names are
re-exported by :mod:`asyncrl`.
"""
