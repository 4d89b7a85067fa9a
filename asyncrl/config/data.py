"""The ``data`` section: where the prompts come from and how they become token ids (``asyncrl.data.prompts``).

Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DataConfig"]


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the prompts come from and how they become token ids (``asyncrl.data.prompts``)."""

    source: Literal["arithmetic", "datasets", "reasoning_gym", "visual_count", "visual_colour"] = "arithmetic"
    """``arithmetic``: the embedded task (``asyncrl.data.tasks``, text prompts with an ``answer``); ``datasets``: a
    file, directory or hub dataset loaded with ``datasets.load_dataset`` (``path``); ``reasoning_gym``: a
    procedural task of reasoning-gym (``task``), rows ``question`` (the prompt), ``answer``, ``metadata``;
    ``visual_count``: "how many red squares?" over a Pillow image (:mod:`asyncrl.data.visual_task`), for a
    vision-language model; ``visual_colour``: "what colour is the square?" (red, green, blue, yellow), the easier
    visual task the tiny VLM learns on CPU. A row of any source may carry ``images`` (encoded bytes or paths)
    referenced by ``{"type": "image"}`` parts of its chat ``messages``: rendered with the model's processor."""
    path: str | None = None
    """``datasets``: a local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, ``.arrow``), a directory of such
    files, or a hub dataset name (needs the network)."""
    format: Literal["json", "parquet", "csv", "arrow"] | None = None
    """``datasets``: the file format; None: from the file suffix (``.jsonl`` is ``json``)."""
    split: str = "train"
    """``datasets``: the split to load."""
    prompt_column: str | None = None
    """The column holding the prompt: text (a str), chat turns (a list of ``{"role", "content"}``, rendered with
    the tokenizer's chat template) or ready token ids (the column ``prompt_ids``). None: the first of
    ``messages``, ``prompt``, ``text``, ``question`` the data has."""
    columns: list[str] | None = None
    """Other columns carried with each prompt to the reward functions (``answer``, ``metadata``, ...); None: all."""
    answer_column: str = "answer"
    """The column holding each prompt's reference answer, which the supervised warm start (``train.sft_steps``)
    trains on; with ``train.sft_steps`` > 0 every row must have a non-empty value in it."""
    num_prompts: int | None = None
    """``datasets``: keep the first n rows (None: all); ``arithmetic`` and ``reasoning_gym``: generate n prompts
    (None: 1024)."""
    seed: int = 0
    """Seed of the generated tasks (``arithmetic``, ``reasoning_gym``)."""
    max_operand: int = 9
    """``arithmetic``: operands are in ``[0, max_operand]``."""
    task: str | None = None
    """``reasoning_gym``: the task name, e.g. ``basic_arithmetic``, ``chain_sum``, ``leg_counting``."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """``reasoning_gym``: the task's own settings (passed to ``reasoning_gym.create_dataset``), e.g.
    ``{min_digits: 1, max_digits: 1}``."""
    chat_template: bool | None = None
    """None: chat turns are rendered with the tokenizer's chat template, text as ``bos + text``; True: text prompts
    too, as one user turn; False: never (chat turns are then an error)."""
    system_prompt: str | None = None
    """With the chat template: a system turn put first, unless the prompt starts with one."""
    max_prompt_length: int | None = None
    """Prompts longer than this many tokens (after rendering) are dropped, counted and logged; None: all kept."""

    def __post_init__(self) -> None:
        if self.source == "datasets" and not self.path:
            raise ValueError("data.source='datasets' needs data.path (a .jsonl/.json/.parquet/.csv/.arrow file, a "
                             "directory of them, or a hub dataset name)")
        if self.source == "reasoning_gym" and not self.task:
            raise ValueError("data.source='reasoning_gym' needs data.task, e.g. data.task=basic_arithmetic")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"data.num_prompts={self.num_prompts} must be >= 1 (or None)")
        if not self.answer_column:
            raise ValueError("data.answer_column must name a column (the warm start's reference answers), e.g. answer")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} must be >= 1 (or None)")
