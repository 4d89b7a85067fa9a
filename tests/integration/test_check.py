"""``asyncrl check``: the healthy tiny models pass; each injected fault fails the right stage, which names it.

Faults come in through real plug points (``--engine tests.integration._check_faults:Class``, a model directory
edited on disk): q and k swapped at the engine, a tied embedding not updated, an engine one update behind, a
LoRA update the engine ignores. The runner itself: a missing or raising stage is a failed stage (the command
goes on and exits 1), usage errors exit 2. Each run starts real processes (an engine process fed by a shm
broadcaster, trainer ranks), so runs are few and small (2 prompts x 2 samples x 8 tokens).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.check.runner import main as check_main
from asyncrl.codec import loads_json

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = Path(__file__).parents[2]
FAULTS = "tests.integration._check_faults"
SMALL = ["--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--temperature", "0.9", "--top-k", "20",
         "--ranks", "1"]
MINE = ("structure", "weight_sync", "logprobs")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The character-level tiny model and its MHA + tied-embeddings edit (q and k of one shape; lm_head tied)."""
    from asyncrl.testing.tiny_model import build_tiny_model
    from tests.integration._check_faults import mha_tied_model

    root = tmp_path_factory.mktemp("check")
    tiny = build_tiny_model(root / "tiny", seed=0)
    return {"root": root, "tiny": tiny, "mha_tied": mha_tied_model(tiny, root / "mha-tied")}


def _check(models: dict[str, Path], name: str, *args: str) -> tuple[int, dict]:
    """Runs the command in this process; returns the exit status and its JSON."""
    out = models["root"] / f"{name}.json"
    code = check_main([*SMALL, "--json", str(out), *args])
    return code, loads_json(out.read_bytes())


def _stage(summary: dict, name: str) -> dict:
    return next(s for s in summary["stages"] if s["stage"] == name)


def _named(stage: dict) -> str:
    return " ".join(str(o.get("name", "")) + " " + str(o.get("what", "")) for o in stage["offenders"])


def test_check_cli_on_the_tiny_model_at_2_ranks(models, capsys):
    """The CI run: every stage through the CLI, 2 DDP ranks; a stage not in the tree yet is a named failure. One rank
    count, one launch per stage (``--ranks 1,2`` launches 1, 2 and 1 ranks for the checkpoint's N -> M loads; make
    test loads 1 -> 2 and 2 -> 1 under FSDP2 in test_check_stages.py, DDP's in make test-all)."""
    out = models["root"] / "ci.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "check", "--model", str(models["tiny"]),
                           *SMALL[:-2], "--ranks", "2", "--json", str(out)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900, check=False, cwd=ROOT)
    wall = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nasyncrl check on the tiny model (all stages, 2 ranks): {wall:.1f} s wall\n{proc.stdout}")
    summary = loads_json(out.read_bytes())
    for name in MINE:
        assert _stage(summary, name)["ok"], proc.stdout
    missing = [s for s in ("parallel", "checkpoint", "loss") if importlib.util.find_spec(f"asyncrl.check.{s}") is None]
    for name in missing:
        assert "stage not implemented" in _stage(summary, name)["summary"]
    assert proc.returncode == (1 if missing or not summary["ok"] else 0), proc.stdout + proc.stderr[-3000:]
    lp = _stage(summary, "logprobs")["metrics"]["phases"]
    assert {"before step", "after step", "after resume", "2 ddp ranks, rank 0", "2 ddp ranks, rank 1"} <= set(lp)
    assert lp["after step"]["topk"]["tokens"] > lp["after step"]["tokens"]  # more than the sampled tokens
    assert "stage" in proc.stdout and "seconds" in proc.stdout


@pytest.mark.extended  # healthy variants; make test keeps the CLI run and every fault
def test_check_lora_and_chat_template_pass(models, tiny_chat_model):
    code, summary = _check(models, "lora", "--model", str(models["tiny"]), "--lora", "4", "--stages", ",".join(MINE))
    assert code == 0, summary
    ws = _stage(summary, "weight_sync")["metrics"]
    assert ws["mode"] == "lora" and ws["phases"]["after step"]["differ"] == 0
    assert ws["phases"]["after step"]["unchanged_by_step"] < ws["phases"]["after step"]["tensors"]
    code, summary = _check(models, "chat", "--model", tiny_chat_model, "--chat-template", "--stages", ",".join(MINE))
    assert code == 0, summary


@pytest.mark.extended  # healthy variants; make test keeps the CLI run and every fault
@pytest.mark.slow
def test_check_qlora_adapter_on_the_4bit_base_passes(models):
    code, summary = _check(models, "qlora", "--model", str(models["tiny"]), "--lora", "4", "--qlora",
                           "--stages", ",".join(MINE))
    assert code == 0, summary
    assert _stage(summary, "structure")["metrics"]["engine_tensors"] > 27  # the 4-bit base's quantization state too
    assert _stage(summary, "weight_sync")["metrics"]["mode"] == "lora"


@pytest.mark.extended  # healthy variants; make test keeps the CLI run and every fault
def test_check_mha_tied_model_passes_and_reports_the_tie(models):
    code, summary = _check(models, "mha-tied", "--model", str(models["mha_tied"]), "--stages", ",".join(MINE))
    assert code == 0, summary
    assert ["lm_head.weight", "model.embed_tokens.weight"] in _stage(summary, "structure")["metrics"]["trainer_tied"]


def test_check_names_q_and_k_swapped_at_the_engine(models):
    code, summary = _check(models, "qk", "--model", str(models["mha_tied"]), "--engine", f"{FAULTS}:QKSwapEngine",
                           "--stages", "structure,weight_sync,logprobs")
    assert code == 1
    assert _stage(summary, "structure")["ok"]  # same names and shapes: only the values are wrong
    ws = _stage(summary, "weight_sync")
    assert not ws["ok"] and ws["metrics"]["phases"]["before step"]["differ"] == 2
    assert "self_attn.q_proj.weight engine differs" in _named(ws) and "self_attn.k_proj.weight" in _named(ws)
    assert not _stage(summary, "logprobs")["ok"]


def test_check_names_a_tied_embedding_not_updated(models):
    code, summary = _check(models, "tied", "--model", str(models["mha_tied"]), "--engine",
                           f"{FAULTS}:TiedNotUpdatedEngine", "--stages", "weight_sync")
    ws = _stage(summary, "weight_sync")
    assert code == 1 and not ws["ok"]
    assert ws["metrics"]["phases"]["before step"]["differ"] == 0  # version 1 is the model's own weights
    assert [o["name"] for o in ws["offenders"]] == ["lm_head.weight"] and ws["offenders"][0]["phase"] == "after step"


def test_check_fails_an_engine_one_update_behind(models):
    code, summary = _check(models, "behind", "--model", str(models["tiny"]), "--engine", f"{FAULTS}:OneBehindEngine",
                           "--stages", "weight_sync,logprobs")
    assert code == 1
    ws, lp = _stage(summary, "weight_sync"), _stage(summary, "logprobs")
    assert ws["metrics"]["phases"]["before step"]["differ"] == 0 and ws["metrics"]["phases"]["after step"]["differ"] > 0
    assert all(o["phase"] == "after step" for o in ws["offenders"])
    assert not lp["ok"] and all(p.startswith("after") for p in lp["metrics"]["problems"])
    assert lp["metrics"]["phases"]["before step"]["max_abs_diff"] < 1e-4
    assert "context" in lp["offenders"][0] and "[" in lp["offenders"][0]["context"]


def test_check_fails_a_lora_update_the_engine_ignores(models):
    code, summary = _check(models, "lora-ignored", "--model", str(models["tiny"]), "--lora", "4", "--engine",
                           f"{FAULTS}:IgnoresLoraEngine", "--stages", "weight_sync,logprobs")
    assert code == 1
    ws, lp = _stage(summary, "weight_sync"), _stage(summary, "logprobs")
    assert not ws["ok"] and all("lora_" in o["name"] and o["phase"] == "after step" for o in ws["offenders"])
    assert not lp["ok"] and any(p.startswith("after step") for p in lp["metrics"]["problems"])


def test_check_runner_reports_a_raising_stage_and_refuses_bad_usage(models, capsys):
    code, summary = _check(models, "broken", "--model", str(models["tiny"]), "--engine", f"{FAULTS}:BrokenEngine",
                           "--stages", "weight_sync,structure")
    assert code == 1 and [s["stage"] for s in summary["stages"]] == ["structure", "weight_sync"]  # STAGES order
    assert all(not s["ok"] and "engine process" in s["summary"] for s in summary["stages"])
    assert "deliberately broken" in _stage(summary, "weight_sync")["offenders"][0]["what"]
    for bad in (["--ranks", "0"], ["--threshold", "logprobs.nope=1"], ["--stages", "structure,bogus"],
                ["--engine", "tests.integration._check_faults:mha_tied_model"], ["--qlora"],
                ["--lora", "4", "--qlora", "--engine", "vllm"], ["--lora", "4", "--qlora", "--parallel", "fsdp2"]):
        with pytest.raises(SystemExit) as e:
            check_main(["--model", str(models["tiny"]), *bad])
        assert e.value.code == 2, bad


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended  # the vLLM engine through every stage (make test-all); make test checks faults on HF
def test_check_vllm_full_and_lora_pass_and_an_ignored_lora_update_fails(models):
    code, summary = _check(models, "vllm", "--model", str(models["mha_tied"]), "--engine", "vllm",
                           "--stages", ",".join(MINE))
    assert code == 0, summary
    assert "qkv_proj" in str(_stage(summary, "structure")["metrics"]["mapping"])
    code, summary = _check(models, "vllm-lora-ignored", "--model", str(models["tiny"]), "--lora", "4",
                           "--engine", f"{FAULTS}:IgnoresLoraVLLMEngine", "--stages", "weight_sync,logprobs")
    ws, lp = _stage(summary, "weight_sync"), _stage(summary, "logprobs")
    # the adapter vLLM loaded is read back from its LoRA layers: the ignored update is named per tensor
    assert ws["metrics"]["phases"]["after step"]["unverifiable"] == 0
    assert not ws["ok"] and all("lora_" in o["name"] and o["phase"] == "after step" for o in ws["offenders"])
    assert code == 1 and not lp["ok"] and any(p.startswith("after step") for p in lp["metrics"]["problems"])


@pytest.mark.vllm
@pytest.mark.extended
def test_check_vllm_lora_on_the_bpe_chat_model_at_1_and_2_ranks(models, tiny_chat_model):
    """The rest of the healthy matrix on vLLM: a LoRA adapter, the chat template, 2 FSDP2 trainer ranks."""
    code, summary = _check(models, "vllm-chat-lora", "--model", tiny_chat_model, "--engine", "vllm", "--lora", "4",
                           "--chat-template", "--parallel", "fsdp2", "--stages", ",".join(MINE), "--ranks", "1,2")
    assert code == 0, summary
    assert _stage(summary, "weight_sync")["metrics"]["phases"]["after step"]["unverifiable"] == 0
    assert "2 fsdp2 ranks, rank 1" in _stage(summary, "logprobs")["metrics"]["phases"]
