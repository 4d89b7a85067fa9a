"""asyncrl check's stages ``parallel``, ``checkpoint`` and ``loss`` on the tiny models: healthy models pass (1 and 2
gloo ranks, full and LoRA, the character-level and the BPE chat model) and each injected fault fails the right
stage, naming the thing: an FSDP2 shard at another rank's offset (``parallel``), a resume that drops the optimizer
state (``checkpoint``), positions shifted by one for left-padded rows (``loss``).

Faults come in through ``CheckContext.imports`` (modules every check process imports first), each monkeypatching one
library function every rank calls: ``_fault_shard_offset`` (``asyncrl.train.parallel.parallelize``),
``_fault_drop_optimizer`` (``Checkpointer.load_model``), ``_fault_left_positions``
(``asyncrl.train.logprobs.position_ids``). Rank launches cost an interpreter start each, so the matrix is split: the
common cases here, the rest extended.
"""

from __future__ import annotations

import sys

import pytest

from asyncrl.check import CheckContext, StageResult

pytestmark = [pytest.mark.integration]


@pytest.fixture(autouse=True)
def _undo_fault_patches():
    """A stage imports ``ctx.imports`` in this process too (the ``loss`` stage runs here), so a fault module's
    monkeypatch would outlive its test and break every later test of the library function it replaces (in CI it
    failed the Checkpointer and QLoRA checkpoint tests that ran after this file): put the functions back and
    forget the fault modules after each test."""
    import asyncrl.train.logprobs
    import asyncrl.train.parallel
    from asyncrl.checkpoint.checkpointer import Checkpointer

    saved = (Checkpointer.load_model, asyncrl.train.logprobs.position_ids, asyncrl.train.parallel.parallelize)
    yield
    Checkpointer.load_model, asyncrl.train.logprobs.position_ids, asyncrl.train.parallel.parallelize = saved
    for name in [m for m in sys.modules if m.startswith("tests.integration._fault_")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> str:
    from asyncrl.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-char") / "model"))


def _ctx(model: str, tmp_path, **kw) -> CheckContext:
    return CheckContext(model=model, workdir=str(tmp_path), **kw)


def _model_ctx(request, which: str, tmp_path, **kw) -> CheckContext:
    """The character-level model with text prompts, or the BPE chat model with prompts through its chat template."""
    model = request.getfixturevalue("tiny_chat_model" if which == "chat" else "char_model")
    return _ctx(model, tmp_path, chat_template=which == "chat", **kw)


def _names(result: StageResult) -> list[str]:
    return [o["name"] for o in result.offenders]


def _passes(result: StageResult) -> None:
    print(f"{result.stage}: {result.summary} ({result.seconds:.1f} s)")
    assert result.ok, (result.summary, result.offenders)


# -- parallel ------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("which,parallel,lora,ranks", [
    ("char", "fsdp2", 0, [1, 2]),
    pytest.param("chat", "fsdp2", 4, [2], marks=pytest.mark.extended),  # make test: the CLI run's DDP + this FSDP2
    pytest.param("char", "ddp", 4, [1, 2], marks=pytest.mark.extended),
    pytest.param("chat", "ddp", 0, [2], marks=pytest.mark.extended),
])
def test_parallel_healthy_models_match_one_process_bit_for_bit(request, tmp_path, which, parallel, lora, ranks):
    from asyncrl.check import parallel as stage

    result = stage.run(_model_ctx(request, which, tmp_path, parallel=parallel, lora_rank=lora, ranks=ranks))
    _passes(result)
    for n in ranks:
        m = result.metrics["ranks"][str(n)]
        assert m["tensors_differ"] == 0 and m["logits_max_abs"] <= 1e-5 and m["logits_vs_rank0"] <= 1e-5, m


@pytest.mark.slow
def test_parallel_names_an_fsdp2_shard_at_another_ranks_offset(char_model, tmp_path):
    from asyncrl.check import parallel as stage
    from tests.integration._fault_shard_offset import PARAMETER

    result = stage.run(_ctx(char_model, tmp_path, parallel="fsdp2", ranks=[2],
                            imports=["tests.integration._fault_shard_offset"]))
    print(result.summary, result.offenders)
    assert not result.ok
    tensor = [o for o in result.offenders if o["name"] == PARAMETER]
    assert tensor and "differs from one process" in tensor[0]["what"], result.offenders
    assert tensor[0]["shard_rank"] == 1 and tensor[0]["first_row"] == 32 and tensor[0]["max_abs"] > 0
    # only that tensor: the others were sharded right
    assert [n for n in _names(result) if not n.endswith("logits")] == [PARAMETER]


# -- checkpoint ----------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("which,parallel,lora,ranks", [
    ("char", "fsdp2", 0, [1, 2]),
    pytest.param("chat", "fsdp2", 4, [2], marks=pytest.mark.extended),
    pytest.param("chat", "ddp", 4, [1, 2], marks=pytest.mark.extended),
])
def test_checkpoint_saved_at_n_loads_at_m_bit_for_bit(request, tmp_path, which, parallel, lora, ranks):
    from asyncrl.check import checkpoint as stage

    result = stage.run(_model_ctx(request, which, tmp_path, parallel=parallel, lora_rank=lora, ranks=ranks))
    _passes(result)
    loads = result.metrics["loads"]
    expected = {f"load{n}to{n}" for n in ranks} | ({"load1to2", "load2to1"} if len(ranks) > 1 else set())
    assert set(loads) == expected and all(v["offenders"] == 0 for v in loads.values())
    saved = result.metrics[f"saved_x{ranks[0]}"]
    assert saved["optim_tensors"] > 0 and saved["optim_tensors"] % 3 == 0  # AdamW: step, exp_avg, exp_avg_sq each


def test_checkpoint_plan_covers_both_directions():
    from asyncrl.check.checkpoint import plan

    launches = plan([1, 2])
    assert [(n, [t["name"] for t in tasks]) for n, tasks in launches] == [
        (1, ["save1", "load1to1"]), (2, ["load1to2", "save2", "load2to2"]), (1, ["load2to1"])]
    assert [t["full"] for _, tasks in launches for t in tasks if t["kind"] == "load"] == [True, False, True, False]
    assert plan([2]) == [(2, [{"name": "save2", "kind": "save", "source": 2},
                              {"name": "load2to2", "kind": "load", "source": 2, "full": True}])]


@pytest.mark.slow
def test_checkpoint_names_the_optimizer_state_a_resume_dropped(char_model, tmp_path):
    from asyncrl.check import checkpoint as stage

    result = stage.run(_ctx(char_model, tmp_path, parallel="fsdp2", ranks=[1], worst=50,
                            imports=["tests.integration._fault_drop_optimizer"]))
    print(result.summary, result.offenders[:3])
    assert not result.ok
    assert result.offenders and all(n.startswith("optim.state.") for n in _names(result)), result.offenders
    assert all("optimizer state differs after resume" in o["what"] for o in result.offenders)
    assert any(n.endswith(".exp_avg") for n in _names(result))


# -- loss ----------------------------------------------------------------------------------------------------------------

TOPK = {"temperature": 0.9, "top_k": 20, "top_p": 0.95}
"""Truncated sampling: prompt tokens outside the top-k/top-p set get -inf trainer logprobs (equal on both sides)."""


@pytest.mark.parametrize("which,lora,sampling", [
    ("char", 0, {}), ("chat", 4, {}), ("char", 0, TOPK),
    pytest.param("char", 4, {}, marks=pytest.mark.extended), pytest.param("chat", 0, TOPK, marks=pytest.mark.extended),
    pytest.param("char", 0, {"engine": "vllm"}, marks=[pytest.mark.vllm, pytest.mark.extended]),
    pytest.param("chat", 4, {"engine": "vllm"}, marks=[pytest.mark.vllm, pytest.mark.extended])])
def test_loss_one_grpo_step_on_the_engines_rollouts(request, tmp_path, which, lora, sampling):
    from asyncrl.check import loss as stage

    result = stage.run(_model_ctx(request, which, tmp_path, lora_rank=lora, ranks=[1], **sampling))
    _passes(result)
    m = result.metrics
    assert m["response_tokens"] > 0 and m["advantages_nonzero"] == m["rows"]
    assert m["left_pad_max_abs"] <= 1e-5 and m["right_pad_max_abs"] <= 1e-5 and m["pad_loss_delta"] <= 1e-5
    assert 0 < m["grad_norm_min"] <= m["grad_norm_max"] < 1e4 and m["params_moved"] == m["params"]


def test_loss_names_positions_shifted_for_left_padded_rows(char_model, tmp_path):
    from asyncrl.check import loss as stage

    result = stage.run(_ctx(char_model, tmp_path, ranks=[1], imports=["tests.integration._fault_left_positions"]))
    print(result.summary, result.offenders)
    assert not result.ok
    assert set(_names(result)) == {"position_ids (left padding)"}, result.offenders  # right padding is fine
    assert "instead of 0, 1, 2" in result.offenders[0]["what"]


@pytest.mark.slow
def test_parallel_fails_naming_a_rank_that_died(char_model, tmp_path):
    from asyncrl.check import parallel as stage

    result = stage.run(_ctx(char_model, tmp_path, parallel="fsdp2", ranks=[2],
                            imports=["tests.integration._fault_rank_dies"]))
    assert not result.ok and result.offenders[0]["what"] == "a rank failed", result.offenders
    assert "rank 1 exited 3" in result.offenders[0]["error"] and "dying at start-up" in result.offenders[0]["error"]


def test_full_precision_stages_skip_under_qlora_before_importing_anything(tmp_path):
    """``--qlora``: parallel, checkpoint and loss say they are skipped (ok, with the reason) and import nothing of
    ``ctx.imports`` (a module that raises on import proves it) and create no work directory."""
    from asyncrl.check import checkpoint, loss, parallel
    from asyncrl.check._policy import QLORA_SKIP

    ctx = CheckContext(model=str(tmp_path / "absent"), qlora=True, lora_rank=4, workdir=str(tmp_path / "work"),
                       imports=["tests.integration._no_such_fault_module"])
    for stage in (parallel, checkpoint, loss):
        result = stage.run(ctx)
        assert (result.ok, result.summary, result.skipped) == (True, "skipped", QLORA_SKIP), stage.__name__
    assert not (tmp_path / "work").exists()
