"""``asyncrl tiny-model DIR [--chat | --vlm]`` and the ``python -m asyncrl.testing.tiny_model/tiny_bpe DIR`` entry
points build a model directory that passes asyncrl's own model check (before: ``python -m workers.tiny_bpe DIR``
exited 0 and built nothing). In-process: the command line's ``main`` and ``runpy``, no subprocess."""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from asyncrl import cli
from asyncrl.models.loading import check_model_dir


def test_asyncrl_tiny_model_builds_a_model_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["tiny-model", str(tmp_path / "model")])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "model")  # the directory, for a script to use
    check_model_dir(str(tmp_path / "model"))
    assert json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "qwen2"


def test_the_module_entry_point_builds_the_chat_model(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m asyncrl.testing.tiny_bpe", str(tmp_path / "chat")])
    runpy.run_module("asyncrl.testing.tiny_bpe", run_name="__main__")
    check_model_dir(str(tmp_path / "chat"))
    tokenizer = json.loads((tmp_path / "chat" / "tokenizer_config.json").read_text())
    assert "chat_template" in tokenizer or (tmp_path / "chat" / "chat_template.jinja").is_file()


def test_tiny_model_refuses_two_kinds_at_once(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["tiny-model", str(tmp_path / "m"), "--chat", "--vlm"])
    assert done.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
