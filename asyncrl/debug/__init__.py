"""The RL debugger: says where a bad update came from.

- :mod:`~asyncrl.debug.record`: the per-step record (distributions, provenance) as compact JSONL.
- :mod:`~asyncrl.debug.detectors`: anomaly detectors and the capture of offending batches as dumps.
- :mod:`~asyncrl.debug.replay`: ``asyncrl replay DUMP --checkpoint CKPT``, token by token.
- :mod:`~asyncrl.debug.align`: ``asyncrl align --model DIR``, the rollout/trainer logprob alignment gate.
- :mod:`~asyncrl.debug.report`: ``asyncrl report RUN_DIR``, a self-contained HTML page of a run.
- :mod:`workers.faults`: fault injection into workers, for the debugger's own tests.
"""
