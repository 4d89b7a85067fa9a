"""Fault for tests/integration/test_check_stages.py, imported by every rank (``CheckContext.imports``): a resume
that drops the optimizer state. ``Checkpointer.load_model`` (what ``Checkpointer.load`` calls, and what a resharded
load is) restores the model only; the optimizer keeps its fresh state. The ``checkpoint`` stage must name the
optimizer state."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from asyncrl.checkpoint.checkpointer import MODEL, Checkpointer


def _model_only(self, path):
    state = {MODEL: get_model_state_dict(self.model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(self.model, state[MODEL])


Checkpointer.load_model = _model_only
