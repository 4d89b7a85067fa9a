"""``asyncrl check MODEL``: every link of the chain from a model directory to RL training, verified stage by stage.

Each stage is one module of this package with ``run(ctx: CheckContext) -> StageResult``; the runner
(:mod:`asyncrl.check.runner`) builds the context from the command line, runs the stages in order, prints one
table and writes JSON. Stages: ``structure``, ``parallel`` (split), ``checkpoint`` (save at N ranks, load at M),
``weight_sync``, ``logprobs``, ``loss`` (data format and loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckContext", "StageResult"]


@dataclass(kw_only=True, slots=True)
class StageResult:
    """What one stage found."""

    stage: str
    """The stage's name (``structure``, ``parallel``, ``checkpoint``, ``weight_sync``, ``logprobs``, ``loss``)."""
    ok: bool
    """False: the stage found a fault (the command exits non-zero)."""
    summary: str
    """One line for the table: what was checked and the headline number (``412 tensors, max |d| 0``)."""
    offenders: list[dict[str, Any]] = field(default_factory=list)
    """The worst findings, worst first, each naming the thing (``{"name": "model.layers.0.self_attn.q_proj.weight",
    "what": "engine differs", "max_abs": 0.31}``); at most ``CheckContext.worst`` of them."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Every number the stage measured (JSON-serialisable), for the ``--json`` output."""
    seconds: float = 0.0
    skipped: str | None = None
    """Why the stage did not run (e.g. ``--ranks 1`` for reshard); a skipped stage is ``ok``."""


@dataclass(kw_only=True, slots=True)
class CheckContext:
    """The command line, resolved: what every stage reads."""

    model: str
    """The model directory (HF format)."""
    engine: str = "hf"
    """The rollout engine: ``hf`` or ``vllm``."""
    parallel: str = "ddp"
    """``ddp`` or ``fsdp2``."""
    ranks: list[int] = field(default_factory=lambda: [1, 2])
    lora_rank: int = 0
    """0: full fine-tuning; r > 0: a LoRA adapter of rank r (adapter-only sync)."""
    qlora: bool = False
    chat_template: bool = False
    dtype: str = "float32"
    thresholds: dict[str, float] = field(default_factory=dict)
    """Per-stage thresholds (defaults per dtype from :mod:`asyncrl.check.runner`; flags override)."""
    worst: int = 5
    """Offenders listed per stage."""
    workdir: str = ""
    """A scratch directory for the stages' files (checkpoints, rollouts); removed after the run unless kept."""
    seed: int = 0
    imports: list[str] = field(default_factory=list)
    """Modules every process of the check imports first (the runner and each rank it launches): register a custom
    architecture (``AutoModelForCausalLM.register``) or, in tests, inject a fault by monkeypatching the library."""
    engine_class: str | None = None
    """``--engine module:Class``: an :class:`~workers.engines.base.Engine` subclass of the HF or vLLM engine built in
    place of ``engine`` (``engine`` is then its kind, ``hf`` or ``vllm``); e.g. a fault engine of the tests."""
    temperature: float = 1.0
    """The generation sampling settings the logprobs stage checks under (the run's ``engine`` section)."""
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    prompts: int = 4
    """Prompts generated from per check (arithmetic prompts, or chat turns with ``chat_template``)."""
    samples: int = 2
    """Responses per prompt."""
    topk_logprobs: int = 8
    """Tokens of the engine's processed distribution compared per position (``SamplingParams(logprobs=K)``)."""
    keep_workdir: bool = False
    """Keep ``workdir`` after the run (its checkpoints and rollouts, to look at a failure)."""
    faults: list[str] = field(default_factory=list)
    """Test-only fault injection by name (``qk_swap``, ``tied_not_updated``, ...): each stage that knows a name
    injects it; see ``tests/`` for the list. Empty in normal use."""
