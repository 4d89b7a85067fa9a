"""Prompts from your data, rendered to token ids once, in the trainer.

``prompts.py``: the ``data:`` section's loader (files, hub datasets, reasoning-gym, the embedded tasks) and the one
rendering function; ``images.py``: images in prompts (bytes end to end, checked, named by their SHA-256);
``tasks.py`` and ``visual_task.py``: the embedded tasks the tiny models learn on CPU.
"""

from asyncrl.data.prompts import PromptSet, load_prompts, render_prompt, sft_batch

__all__ = ["PromptSet", "load_prompts", "render_prompt", "sft_batch"]
