"""``asyncrl check --model DIR``: runs every stage of the chain on a model directory, one table, JSON, an exit status.

::

    asyncrl check --model DIR [--engine hf|vllm|module:Class] [--parallel ddp|fsdp2] [--ranks 1,2]
                  [--lora RANK] [--qlora] [--chat-template] [--dtype float32|bfloat16]
                  [--stages structure,weight_sync,...] [--threshold logprobs.max_abs=0.2 ...] [--json OUT]

    parse ─► CheckContext ─► for each stage: import asyncrl.check.<stage>; run(ctx) -> StageResult ─► table, JSON
                                             (a stage that is missing or raises is a failed stage, named)

Exit status: 0 when every stage passed (or was skipped with a reason), 1 when any failed, 2 for usage errors.
Who blocks on what: the stages run one after another in this process; each launches what it needs and waits for
it with a deadline: trainer ranks (:mod:`asyncrl.check._ranks`, torchrun's environment), and the rollout engine
in a child process fed by a real weight broadcaster (:mod:`asyncrl.check._engine`). Stages share nothing but
``ctx.workdir`` (a temporary directory, removed at the end unless ``--keep-workdir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from asyncrl.check import CheckContext, StageResult

__all__ = ["STAGES", "format_table", "main", "parse_context", "run_check", "run_stage"]

STAGES = ("structure", "parallel", "checkpoint", "weight_sync", "logprobs", "loss")
"""Every stage, in the order they run (each module ``asyncrl.check.<name>`` with ``run(ctx)``)."""
_ENGINE_KINDS = ("hf", "vllm")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (config.json, weights, tokenizer)")
    p.add_argument("--engine", default="hf",
                   help="rollout engine: hf, vllm, or module:Class (a subclass of the HF or vLLM engine)")
    p.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp")
    p.add_argument("--ranks", default="1,2", help="trainer rank counts, comma-separated (e.g. 1,2,4)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="check a LoRA adapter of this rank (0: full)")
    p.add_argument("--qlora", action="store_true", help="the LoRA adapter over a 4-bit base (needs --lora)")
    p.add_argument("--chat-template", action="store_true", help="prompts as chat turns through the tokenizer's template")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--threshold", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="override a default threshold (asyncrl.check.thresholds), e.g. logprobs.max_abs=0.2")
    p.add_argument("--temperature", type=float, default=1.0, help="generation sampling settings checked under")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--topk-logprobs", type=int, default=8, help="top tokens of the engine's distribution compared")
    p.add_argument("--worst", type=int, default=5, help="offenders listed per stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--json", help="write every StageResult here")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="a module every check process imports first (e.g. one registering a custom architecture)")
    p.add_argument("--fault", action="append", default=[], help=argparse.SUPPRESS)  # CheckContext.faults (tests)
    return p


def _qlora_available() -> bool:
    """Whether the QLoRA trainer/engine path (issue 15, ``lora.qlora``) is in this tree."""
    from asyncrl.config import LoraConfig

    return "qlora" in LoraConfig.__dataclass_fields__


def parse_context(argv: list[str]) -> tuple[CheckContext, list[str], str | None]:
    """The command line as ``(context, stages to run, --json path)``; usage errors exit 2 with the reason."""
    from asyncrl.check.thresholds import thresholds_for

    parser = _parser()
    a = parser.parse_args(argv)
    from asyncrl.models.loading import ModelDirError, check_model_dir

    try:  # the message every entry point gives for a path that is not a model (config.json, weights, headers)
        check_model_dir(a.model, key="--model")
    except ModelDirError as e:
        parser.error(str(e).partition("; `asyncrl check")[0])
    if not Path(a.model, "config.json").is_file():  # a hub id: check needs the directory itself
        parser.error(f"--model {a.model} is not a model directory (no config.json)")
    try:
        ranks = sorted({int(r) for r in a.ranks.split(",") if r.strip()})
    except ValueError:
        parser.error(f"--ranks {a.ranks!r} must be comma-separated integers, e.g. 1,2,4")
    if not ranks or ranks[0] < 1:
        parser.error(f"--ranks {a.ranks!r}: every rank count must be >= 1")
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    if unknown := [s for s in stages if s not in STAGES]:
        parser.error(f"--stages: unknown {unknown}; choose from {list(STAGES)}")
    engine, engine_class = a.engine, None
    if ":" in engine:
        engine_class = engine
        try:
            engine = engine_kind(engine_class)
        except (ImportError, AttributeError, TypeError) as e:
            parser.error(f"--engine {a.engine}: {e}")
    elif engine not in _ENGINE_KINDS:
        parser.error(f"--engine {engine!r}: choose hf, vllm or module:Class")
    if a.lora < 0 or (a.qlora and not a.lora):
        parser.error(f"--lora {a.lora} must be >= 0, and --qlora needs --lora RANK")
    if a.qlora and not _qlora_available():
        parser.error("--qlora: this asyncrl has no QLoRA support yet (lora.qlora, issue 15); check the adapter "
                     "over a full-precision base with --lora RANK instead")
    if a.qlora:
        from asyncrl.models.qlora import FSDP2_REFUSAL, VLLM_REFUSAL

        if engine == "vllm":
            parser.error(f"--qlora with --engine {a.engine}: {VLLM_REFUSAL}")
        if a.parallel == "fsdp2":
            parser.error(f"--qlora with --parallel fsdp2: {FSDP2_REFUSAL}")
    for module in a.imports:
        try:
            importlib.import_module(module)
        except ImportError as e:
            parser.error(f"--import {module}: {e}")
    overrides = {}
    for item in a.threshold:
        key, sep, value = item.partition("=")
        try:
            overrides[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            parser.error(f"--threshold {item!r} must be STAGE.KEY=NUMBER, e.g. logprobs.max_abs=0.2")
    try:
        thresholds = thresholds_for(a.dtype, overrides)
    except ValueError as e:
        parser.error(str(e))
    if a.prompts < 1 or a.samples < 1 or a.max_new_tokens < 1 or a.topk_logprobs < 1 or a.worst < 0:
        parser.error("--prompts, --samples, --max-new-tokens and --topk-logprobs must be >= 1, --worst >= 0")
    ctx = CheckContext(model=str(Path(a.model).resolve()), engine=engine, parallel=a.parallel, ranks=ranks,
                       lora_rank=a.lora, qlora=a.qlora, chat_template=a.chat_template, dtype=a.dtype,
                       thresholds=thresholds, worst=a.worst, workdir=a.workdir or "", seed=a.seed, faults=a.fault,
                       engine_class=engine_class, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                       max_new_tokens=a.max_new_tokens, prompts=a.prompts, samples=a.samples,
                       topk_logprobs=a.topk_logprobs, keep_workdir=a.keep_workdir, imports=a.imports)
    return ctx, stages, a.json


def engine_kind(engine_class: str) -> str:
    """``hf`` or ``vllm``: which built-in engine the ``module:Class`` engine subclasses (imported here).

    Raises:
        TypeError: the class subclasses neither.
    """
    from workers.engines.hf import HFEngine
    from workers.engines.vllm_engine import VLLMEngine

    module, _, name = engine_class.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if isinstance(cls, type) and issubclass(cls, VLLMEngine):
        return "vllm"
    if isinstance(cls, type) and issubclass(cls, HFEngine):
        return "hf"
    raise TypeError(f"{engine_class} must subclass workers.engines.hf.HFEngine or vllm_engine.VLLMEngine")


def run_stage(name: str, ctx: CheckContext) -> StageResult:
    """Runs one stage; a missing module or an exception is a failed :class:`StageResult` naming the error."""
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"asyncrl.check.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"asyncrl.check.{name}":
            raise
        return StageResult(stage=name, ok=False, summary=f"stage not implemented (no asyncrl.check.{name})",
                           seconds=time.perf_counter() - t0)
    try:
        result = module.run(ctx)
    except Exception as e:  # noqa: BLE001 - a stage's crash is its failure, reported with the rest: the command goes on
        tb = traceback.format_exc(limit=-6)
        return StageResult(stage=name, ok=False, summary=f"raised {type(e).__name__}: {e}"[:300],
                           offenders=[{"name": type(e).__name__, "what": str(e)[:2000], "traceback": tb}],
                           seconds=time.perf_counter() - t0)
    result.seconds = result.seconds or time.perf_counter() - t0
    result.offenders = result.offenders[: ctx.worst]
    return result


def run_check(ctx: CheckContext, stages: list[str] | None = None) -> list[StageResult]:
    """Every selected stage on ``ctx`` (its ``workdir`` made, and removed afterwards unless kept)."""
    own = not ctx.workdir
    if own:
        ctx.workdir = tempfile.mkdtemp(prefix="asyncrl-check-")
    Path(ctx.workdir).mkdir(parents=True, exist_ok=True)
    from asyncrl.check._chain import close_shared

    order = [s for s in STAGES if s in (stages or STAGES)]  # structure first: it reads the engine before any update
    try:
        return [run_stage(name, ctx) for name in order]
    finally:
        close_shared(ctx)
        if own and not ctx.keep_workdir:
            shutil.rmtree(ctx.workdir, ignore_errors=True)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_table(results: list[StageResult]) -> str:
    """One row per stage (stage, result, seconds, summary), its worst offenders indented under it."""
    lines = [f"{'stage':<12} {'result':<6} {'seconds':>8}  summary"]
    for r in results:
        verdict = "SKIP" if r.skipped else ("PASS" if r.ok else "FAIL")
        summary = r.summary if not r.skipped else f"skipped: {r.skipped}"
        lines.append(f"{r.stage:<12} {verdict:<6} {r.seconds:>8.1f}  {summary}")
        for o in r.offenders:
            name = o.get("name", "?")
            rest = ", ".join(f"{k}={_cell(v)}" for k, v in o.items() if k not in ("name", "traceback"))
            lines.append(f"{'':<29}- {name}: {rest}"[:400])
    failed = [r.stage for r in results if not r.ok]
    lines.append("PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``asyncrl check``; returns 0 (all passed), 1 (a stage failed); usage errors exit 2."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # this process and every one it starts: one table
    ctx, stages, json_path = parse_context(argv)
    t0 = time.perf_counter()
    results = run_check(ctx, stages)
    print(format_table(results), flush=True)
    if json_path:
        from asyncrl.codec import dumps_json

        body = {"ok": all(r.ok for r in results), "seconds": time.perf_counter() - t0,
                "context": dataclasses.asdict(ctx), "stages": [dataclasses.asdict(r) for r in results]}
        Path(json_path).write_bytes(dumps_json(body))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
