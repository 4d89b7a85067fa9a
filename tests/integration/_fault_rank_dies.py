"""Fault for tests/integration/test_check_stages.py (``CheckContext.imports``): rank 1 of a launch dies at start-up
(exit status 3, before joining the process group), so rank 0 would wait for it in the rendezvous forever. The stage
must fail naming the rank and its exit status, and no rank may be left running. The check process itself (no
``RANK`` in its environment) is unaffected."""

from __future__ import annotations

import os
import sys

if os.environ.get("RANK") == "1":
    print("rank 1: dying at start-up (injected)", file=sys.stderr, flush=True)
    os._exit(3)
