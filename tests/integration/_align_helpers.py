"""A model directory and recipe-format checkpoints for the ``asyncrl align`` tests (importable by hand too)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["make_checkpoints", "make_lora_checkpoint"]


def make_checkpoints(root: Path) -> dict[str, Path]:
    """The tiny model at ``root/model`` and two DCP checkpoints in the recipe's format (``{"model": ...}``),
    ``step-000000`` (its weights) and ``step-000001`` (after one AdamW step on a next-token loss)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.data.tasks import arithmetic_prompts
    from asyncrl.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(root / "model", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "step-000000"))  # as the recipe: {"model": ...}
    rows = [[tokenizer.bos_token_id, *tokenizer(p["text"] + p["answer"], add_special_tokens=False).input_ids,
             tokenizer.eos_token_id] for p in arithmetic_prompts(8, seed=1)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "step-000001"))
    return {"dir": root, "model": model_dir, "step0": root / "step-000000", "step1": root / "step-000001"}


def make_lora_checkpoint(root: Path, model_dir: Path) -> Path:
    """``root/lora-000001``: a recipe LoRA checkpoint (adapter on q/v, non-zero ``lora_B``) with the ``lora``
    section of the recipe's ``config.json`` next to it, as ``lora.rank=4`` runs write it."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from asyncrl.codec import dumps_json

    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                                                  target_modules=lora["target_modules"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = root / "lora-000001"
    dcp.save({"model": peft_model.state_dict()}, checkpoint_id=str(path))
    (path / "config.json").write_bytes(dumps_json({"lora": lora}))
    return path


if __name__ == "__main__":
    import sys

    print(make_checkpoints(Path(sys.argv[1])))
