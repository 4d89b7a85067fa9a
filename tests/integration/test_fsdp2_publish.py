"""FSDP2 publishes without a full gather per rank (asyncrl.weights.state): at 2 and 4 gloo ranks, a worker
(shm receiver + HF engine) ends up holding, bit for bit, what a single process publishes for the same model,
in ``full`` mode, ``lora`` mode (adapter keys only) and ``full`` mode of a peft model (merged); and no rank
ever holds more than one gather group (``bucket_bytes``, or the largest tensor if that is larger) of
gathered tensors at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.weights.state import policy_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
DRIVER = Path(__file__).with_name("_fsdp2_publish_driver.py")
BUCKET = 40_000
"""Bytes per gather group: the tiny model (~0.4 MB in fp32) streams in a dozen groups or more."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_fsdp2_streamed_publish_equals_single_process_bit_for_bit(tmp_path, nproc):
    from safetensors.torch import load_file

    from tests.integration._fsdp2_publish_driver import build

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(DRIVER),
         str(tmp_path), str(BUCKET)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert len(ranks) == nproc
    model_dir = str(tmp_path / "model")
    for version, (lora, mode) in enumerate([(False, "full"), (True, "lora"), (True, "full")], start=1):
        reference = policy_state(build(model_dir, lora=lora), mode)  # one process, nothing sharded
        held = load_file(str(tmp_path / f"engine-v{version}.safetensors"))
        assert sorted(held) == sorted(reference), f"version {version} ({mode}): the engine holds other names"
        differ = [n for n in reference if not torch.equal(_bits(held[n]), _bits(reference[n]))]
        assert not differ, f"version {version} ({mode}): {differ[:5]} differ from the single-process state"
        if mode == "lora":
            assert all("lora_" in n for n in held)
        for r in ranks:
            p = r["publishes"][version - 1]
            # merging gathers a layer's adapter with its base weight: the adapter's bytes may come on top
            bound = max(BUCKET, p["largest"]) + (r["publishes"][1]["nbytes"] if lora and mode == "full" else 0)
            print(f"{nproc} ranks, rank {r['rank']}, v{version} {mode}{' (peft)' if lora else ''}: peak gathered "
                  f"{p['peak_gathered']} B of {p['nbytes']} B published ({p['peak_gathered'] / p['nbytes']:.1%}), "
                  f"group bound {bound} B")
            assert p["streamed"] and 0 < p["peak_gathered"] <= bound, p
            assert p["peak_gathered"] < p["nbytes"] / 4 or mode == "lora"  # never the whole state
            assert p["state_peak"] <= max(BUCKET, p["largest"])
