"""The ``data:`` section (asyncrl.data.prompts): prompts from files of every format, from reasoning-gym and the embedded
task, rendered once to token ids (chat template included) the way every engine would, with the other columns
kept for the reward functions; over-long prompts dropped and counted; bad data refused naming file and column."""

from __future__ import annotations

import json
import logging

import msgpack
import pytest

from asyncrl.config import DataConfig
from asyncrl.data.prompts import load_prompts, render_prompt, sft_batch
from workers.engines.base import prompt_token_ids

MESSAGES = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 12*3."}],
     "answer": "36"},
]
TEXTS = [{"prompt": "What is 7 plus 8?", "answer": "15", "level": 1}, {"prompt": "1+1=", "answer": "2", "level": 0}]


@pytest.fixture(scope="module")
def tok(tiny_chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_messages_are_rendered_with_the_chat_template(tmp_path, tok, tiny_chat_model):
    prompts = load_prompts(DataConfig(source="datasets", path=_jsonl(tmp_path / "chat.jsonl", MESSAGES)),
                           tiny_chat_model)
    assert len(prompts) == 2 and prompts.dropped_too_long == 0
    for item, row in zip(prompts, MESSAGES):
        text = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")
        assert item["prompt_ids"] == tok(text, add_special_tokens=False).input_ids
        assert tok.decode(item["prompt_ids"]) == text
        assert item["messages"] == row["messages"] and item["answer"] == row["answer"]
        assert set(item) == {"prompt_ids", "messages", "answer"}
        # what any engine computes from the item without the ids is the same (one rendering function)
        assert prompt_token_ids({"messages": row["messages"]}, tok).tolist() == item["prompt_ids"]
        assert msgpack.unpackb(msgpack.packb(item)) == item  # travels in the lease as it is
    assert prompts.lengths == [len(p["prompt_ids"]) for p in prompts]


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json", "arrow", "jsonl"])
def test_every_file_format_loads_text_prompts(tmp_path, fmt, tok):
    import datasets

    table = datasets.Dataset.from_list(TEXTS)
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        table.to_parquet(str(path))
    elif fmt == "csv":
        table.to_csv(str(path), index=False)
    elif fmt == "json":
        path.write_text(json.dumps(TEXTS))
    elif fmt == "jsonl":
        _jsonl(path, TEXTS)
    else:
        path = tmp_path / "arrowdir"
        table.save_to_disk(str(path))
        path = next(path.glob("*.arrow"))
    prompts = load_prompts(DataConfig(source="datasets", path=str(path)), tok)
    assert [p["prompt"] for p in prompts] == [r["prompt"] for r in TEXTS]
    assert [str(p["answer"]) for p in prompts] == ["15", "2"] and [p["level"] for p in prompts] == [1, 0]
    # a text prompt without a chat template: bos (none in Qwen2) + the text's tokens, as the engines did before
    assert prompts[0]["prompt_ids"] == tok(TEXTS[0]["prompt"], add_special_tokens=False).input_ids


def test_text_prompts_with_the_chat_template_and_a_system_prompt(tmp_path, tok):
    cfg = DataConfig(source="datasets", path=_jsonl(tmp_path / "t.jsonl", TEXTS), chat_template=True,
                     system_prompt="Answer with a number.", columns=["answer"], num_prompts=1)
    (item,) = load_prompts(cfg, tok)
    assert tok.decode(item["prompt_ids"]) == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n"
                                              "What is 7 plus 8?<|im_end|>\n<|im_start|>assistant\n")
    assert item["prompt"] == TEXTS[0]["prompt"] and set(item) == {"prompt_ids", "prompt", "answer"}


def test_the_embedded_task_renders_as_the_engines_did(tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.data.tasks import arithmetic_prompts
    from asyncrl.testing.tiny_model import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "char"))
    prompts = load_prompts(DataConfig(num_prompts=20, max_operand=9, seed=3), tok)
    old = arithmetic_prompts(20, seed=3, max_operand=9)
    assert [p["prompt_ids"] for p in prompts] == [prompt_token_ids(o, tok).tolist() for o in old]  # bos + characters
    assert [(p["prompt"], p["answer"]) for p in prompts] == [(o["text"], o["answer"]) for o in old]


def test_reasoning_gym_items_keep_what_its_scorer_needs(tok):
    import reasoning_gym

    cfg = DataConfig(source="reasoning_gym", task="basic_arithmetic", num_prompts=8, seed=1,
                     task_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    prompts = load_prompts(cfg, tok)
    assert len(prompts) == 8
    expected = reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=1, min_terms=2, max_terms=2,
                                            min_digits=1, max_digits=1)
    for item, entry in zip(prompts, expected):
        wire = msgpack.unpackb(msgpack.packb(item))  # as the worker receives it
        assert wire["prompt"] == wire["question"] == entry["question"] and wire["answer"] == entry["answer"]
        assert wire["prompt_ids"] == tok(entry["question"], add_special_tokens=False).input_ids
        score = reasoning_gym.get_score_answer_fn(wire["metadata"]["source_dataset"])
        rebuilt = {"question": wire["question"], "answer": wire["answer"], "metadata": wire["metadata"]}
        assert score(entry["answer"], rebuilt) == 1.0 and score("not a number", rebuilt) == 0.0
    with pytest.raises(ValueError, match="reasoning_gym task 'no_such_task'"):
        load_prompts(DataConfig(source="reasoning_gym", task="no_such_task"), tok)


def test_over_long_prompts_are_dropped_counted_and_logged(tmp_path, tok, caplog):
    rows = [{"prompt": "one two three " * n, "answer": str(n)} for n in range(1, 9)]
    cfg = DataConfig(source="datasets", path=_jsonl(tmp_path / "long.jsonl", rows), max_prompt_length=12)
    with caplog.at_level(logging.WARNING, logger="asyncrl.data.prompts"):
        prompts = load_prompts(cfg, tok)
    lengths = [len(render_prompt(r["prompt"], tok)) for r in rows]
    assert prompts.dropped_too_long == sum(n > 12 for n in lengths) > 0
    assert [p["answer"] for p in prompts] == [r["answer"] for r, n in zip(rows, lengths) if n <= 12]
    assert "dropped" in caplog.text and "data.max_prompt_length=12" in caplog.text
    with pytest.raises(ValueError, match=r"all 8 prompts are longer than data.max_prompt_length=1 tokens"):
        load_prompts(DataConfig(source="datasets", path=cfg.path, max_prompt_length=1), tok)


def test_bad_data_is_refused_naming_file_and_column(tmp_path, tok):
    def load(path, **kw):
        return load_prompts(DataConfig(source="datasets", path=str(path), **kw), tok)

    good = _jsonl(tmp_path / "good.jsonl", TEXTS)
    with pytest.raises(ValueError, match=r"good\.jsonl.*no prompt column 'question'.*\['answer', 'level', 'prompt'\]"):
        load(good, prompt_column="question")
    with pytest.raises(ValueError, match=r"good\.jsonl.*no column\(s\) \['metadata'\]"):
        load(good, columns=["metadata"])
    nameless = _jsonl(tmp_path / "nameless.jsonl", [{"q": "hi", "a": "1"}])
    with pytest.raises(ValueError, match=r"nameless\.jsonl.*no prompt column any of \['messages', 'prompt'"):
        load(nameless)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl.*empty"):
        load(tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank\.jsonl"):
        load(tmp_path / "blank.jsonl")
    with pytest.raises(ValueError, match=r"missing\.jsonl.*no such file"):
        load(tmp_path / "missing.jsonl")
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"data\.txt.*unknown file type '\.txt'"):
        load(tmp_path / "data.txt")
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{"prompt": "ok"}, {"prompt": 5}])
    with pytest.raises(ValueError, match=r"wrong\.jsonl.*row 2, column 'prompt'"):  # rows are 1-based
        load(wrong)
    broken_turns = _jsonl(tmp_path / "turns.jsonl", [{"messages": [{"content": "no role"}]}])
    with pytest.raises(ValueError, match=r"turns\.jsonl.*row 1, column 'messages'.*role"):
        load(broken_turns)
    with pytest.raises(ValueError, match=r"chat\.jsonl.*row 1.*chat_template=False"):
        load(_jsonl(tmp_path / "chat.jsonl", MESSAGES), chat_template=False)


def test_a_column_that_cannot_travel_is_named(tmp_path, tok):
    import datetime

    import datasets

    path = tmp_path / "when.parquet"
    datasets.Dataset.from_list([{"prompt": "hi", "when": datetime.datetime(2026, 1, 1)}]).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"when\.parquet.*row 1, column 'when' cannot travel"):
        load_prompts(DataConfig(source="datasets", path=str(path)), tok)
    (item,) = load_prompts(DataConfig(source="datasets", path=str(path), columns=[]), tok)
    assert set(item) == {"prompt_ids", "prompt"}


def test_chat_turns_need_a_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.testing.tiny_model import build_tiny_model

    char = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "char"))
    with pytest.raises(ValueError, match="chat template"):
        render_prompt([{"role": "user", "content": "hi"}], char)
    with pytest.raises(ValueError, match="chat template"):
        prompt_token_ids({"messages": [{"role": "user", "content": "hi"}]})  # the fake engine has no tokenizer
    assert prompt_token_ids({"text": "hi"}).tolist() == list(b"hi")


def test_config_checks():
    with pytest.raises(ValueError, match="needs data.path"):
        DataConfig(source="datasets")
    with pytest.raises(ValueError, match="needs data.task"):
        DataConfig(source="reasoning_gym")
    with pytest.raises(ValueError, match="max_prompt_length=0"):
        DataConfig(max_prompt_length=0)


def test_the_warm_start_masks_the_prompt_by_its_tokens(tmp_path, tok):
    prompts = load_prompts(DataConfig(source="datasets", path=_jsonl(tmp_path / "chat.jsonl", MESSAGES)), tok)
    ids, labels = sft_batch(list(prompts), tok)
    for b, item in enumerate(prompts):
        n = len(item["prompt_ids"])
        assert ids[b, :n].tolist() == item["prompt_ids"] and (labels[b, :n] == -100).all()
        trained = labels[b][labels[b] != -100].tolist()
        assert tok.decode(trained) == item["answer"] + "<|im_end|>"
        chars = 1 + len(tok.decode(item["prompt_ids"]))  # the old mask, in characters: wrong for BPE
        assert chars != n
    with pytest.raises(ValueError, match=r"trains on column 'answer' \(data.answer_column\).*1 of 1 items have no "
                                         r"value.*set data.answer_column"):
        sft_batch([{"prompt_ids": [1, 2], "prompt": "x"}], tok)
    with pytest.raises(ValueError, match=r"1 of 2 items have no value"):  # None would train the model to say "None"
        sft_batch([{"prompt_ids": [1], "answer": "3"}, {"prompt_ids": [1], "answer": None}], tok)


def test_the_warm_start_s_answer_column_is_configurable(tmp_path, tok):
    rows = [{"prompt": "1+2=", "solution": "3"}, {"prompt": "2+2=", "solution": "4"}]
    prompts = load_prompts(DataConfig(source="datasets", path=_jsonl(tmp_path / "s.jsonl", rows),
                                      answer_column="solution"), tok, required_columns={"solution": "the warm start"})
    ids, labels = sft_batch(list(prompts), tok, answer_column="solution")
    assert tok.decode(labels[0][labels[0] != -100].tolist()).startswith("3")
    with pytest.raises(ValueError, match="answer_column"):
        DataConfig(answer_column="")


@pytest.mark.parametrize(("rows", "needed", "message"), [
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": ""}], {"answer": "the reward function 'exact'"},
     r"empty\.jsonl': row 2: column 'answer', which the reward function 'exact' reads, is empty"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": "3"}], {"answer": "the warm start"},
     r"empty\.jsonl': row 2: column 'answer', which the warm start reads, is empty \(None\)"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "  ", "answer": "2"}], {},
     r"empty\.jsonl': row 2: the prompt \(column 'prompt'\) is empty"),
    ([{"prompt": "a"}], {"answer": "the reward function 'exact'"},
     r"empty\.jsonl': no column 'answer', which the reward function 'exact' reads; its columns are \['prompt'\]"),
    ([{"prompt": "a", "answer": "1"}], {"answer": "the warm start"}, None),  # data.columns leaves it out
], ids=["empty-string", "missing-key", "empty-prompt", "no-column", "dropped-by-columns"])
def test_an_empty_value_the_run_reads_is_refused_with_its_row_and_file(tmp_path, tok, rows, needed, message):
    path = _jsonl(tmp_path / "empty.jsonl", rows)
    if message is None:
        with pytest.raises(ValueError, match=r"data.columns=\[\] leaves out column 'answer'"):
            load_prompts(DataConfig(source="datasets", path=path, columns=[]), tok, required_columns=needed)
        return
    with pytest.raises(ValueError, match=message):
        load_prompts(DataConfig(source="datasets", path=path), tok, required_columns=needed)


def test_image_parts_without_images_are_refused(tmp_path, tok):
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}]
    path = _jsonl(tmp_path / "img.jsonl", [{"messages": turns, "images": []}])
    with pytest.raises(ValueError, match=r"img\.jsonl': row 1: its messages reference 1 image.*column 'images' is empty"):
        load_prompts(DataConfig(source="datasets", path=path), tok)


def test_a_hub_name_offline_is_refused_naming_it(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"data.path='asyncrl-tests/no-such-dataset': could not load split 'train'"):
        load_prompts(DataConfig(source="datasets", path="asyncrl-tests/no-such-dataset"), tok)
