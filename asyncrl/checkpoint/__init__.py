"""Checkpoints a kill cannot break, and the run directory they live in.

``checkpointer.py``: ``run_dir/checkpoints/step-N`` (model, optimizer, each rank's loader state, RNG) and the
``latest`` pointer, written atomically; ``run_dir.py``: the directory held by one run at a time, its records
continued from the resumed step.
"""

from asyncrl.checkpoint.checkpointer import SAVE_POINTS, CheckpointDir, Checkpointer, TrainerState
from asyncrl.checkpoint.run_dir import RunDirLocked, continue_records, hold_run_dir, record_files

__all__ = ["SAVE_POINTS", "CheckpointDir", "Checkpointer", "RunDirLocked", "TrainerState", "continue_records",
           "hold_run_dir", "record_files"]
