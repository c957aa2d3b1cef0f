"""use/task_files.py: each published format, written here as its JSONL files come, becomes
the requests the harness's task YAML makes of it; tinylm's local formats; the errors."""

from __future__ import annotations

import json

import pytest

from tinylm.core.errors import ConfigError, DataError
from tinylm.use.task_files import detect_format, load_task


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_hellaswag_as_the_harness_preprocesses_it(tmp_path) -> None:
    record = {"ind": 24, "activity_label": "Roof shingle removal",
              "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
              "ctx": "A man is sitting on a roof. he", "split": "val",
              "split_type": "indomain", "label": "3", "source_id": "activitynet~v_-JhWjGDPHMY",
              "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                          "is holding a rubik's cube.", "starts pulling up roofing on a roof."]}
    wikihow = dict(record, activity_label="Home and Garden", label=0,
                   ctx_a="[header] How to clean a grill. [title] Heat it up.", ctx_b="",
                   endings=["[step] Scrub it  well.", "b", "c", "d"])
    task = load_task(write(tmp_path / "hellaswag_val.jsonl", [record, wikihow]))
    assert task.name == "hellaswag_val" and task.kind == "multiple_choice"
    a, b = task.items
    assert a.contexts == ("Roof shingle removal: A man is sitting on a roof. He",)
    assert a.continuations[3] == " starts pulling up roofing on a roof." and a.answer == 3
    assert a.choice_texts == tuple(record["endings"])
    assert b.contexts == ("Home and Garden: How to clean a grill.. Heat it up.",)
    assert b.choice_texts[0] == " Scrub it well." and b.answer == 0  # no strip after, as theirs


def test_arc_in_both_layouts(tmp_path) -> None:
    hf = {"id": "Mercury_1", "question": "Which gas do plants take in?",
          "choices": {"text": ["oxygen", "carbon dioxide", "helium"], "label": ["A", "B", "C"]},
          "answerKey": "B"}
    ai2 = {"id": "Mercury_2", "question": {"stem": "What melts ice?", "choices": [
        {"text": "heat", "label": "1"}, {"text": "cold", "label": "2"}]}, "answerKey": "1"}
    task = load_task(write(tmp_path / "ARC-Challenge-Test.jsonl", [hf, ai2]))
    a, b = task.items
    assert a.contexts == ("Question: Which gas do plants take in?\nAnswer:",)
    assert a.continuations == (" oxygen", " carbon dioxide", " helium") and a.answer == 1
    assert b.contexts == ("Question: What melts ice?\nAnswer:",) and b.answer == 0


def test_piqa_with_labels_inline_or_beside_the_file(tmp_path) -> None:
    rows = [{"goal": "Keep bread fresh", "sol1": "Put it in a bag.", "sol2": "Put it in water."},
            {"goal": "Dry a shirt", "sol1": "Soak it.", "sol2": "Hang it in the sun."}]
    path = write(tmp_path / "valid.jsonl", rows)
    with pytest.raises(DataError, match="valid-labels.lst"):
        load_task(path)
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    a, b = load_task(path).items
    assert a.contexts == ("Question: Keep bread fresh\nAnswer:",) and a.answer == 0
    assert b.continuations == (" Soak it.", " Hang it in the sun.") and b.answer == 1
    inline = load_task(write(tmp_path / "piqa.jsonl", [dict(rows[0], label=1)]))
    assert inline.items[0].answer == 1


def test_winogrande_puts_each_option_in_the_context(tmp_path) -> None:
    record = {"qID": "3QHITW7O", "sentence": "Ian volunteered to eat Dennis's menudo after "
              "already having a bowl because _ despised eating intestine.",
              "option1": "Ian", "option2": "Dennis", "answer": "2"}
    item = load_task(write(tmp_path / "wino.jsonl", [record])).items[0]
    head = "Ian volunteered to eat Dennis's menudo after already having a bowl because "
    assert item.contexts == (head + "Ian", head + "Dennis")
    assert item.continuations == (" despised eating intestine.",) * 2 and item.answer == 1
    assert item.pairs("") == [(head + "Ian", " despised eating intestine."),
                              (head + "Dennis", " despised eating intestine.")]
    assert item.shot == head + "Dennis despised eating intestine."
    with pytest.raises(DataError, match="test split"):
        load_task(write(tmp_path / "wino_test.jsonl", [dict(record, answer="")]))


def test_boolq_superglue_and_google(tmp_path) -> None:
    superglue = {"question": "is the sky blue", "passage": "The sky is blue.", "idx": 0,
                 "label": 1}
    google = {"question": "is ice hot", "title": "Ice", "answer": False,
              "passage": "Ice is cold."}
    a, b = load_task(write(tmp_path / "boolq.jsonl", [superglue, google])).items
    assert a.contexts == ("The sky is blue.\nQuestion: is the sky blue?\nAnswer:",)
    assert a.continuations == (" no", " yes") and a.answer == 1 and b.answer == 0


def test_lambada_and_gsm8k(tmp_path) -> None:
    lam = load_task(write(tmp_path / "lambada_test.jsonl",
                          [{"text": "he handed her the cup of tea"}]))
    assert lam.kind == "cloze"
    assert lam.items[0].pairs("") == [("he handed her the cup of", " tea")]
    gsm = load_task(write(tmp_path / "gsm8k_test.jsonl", [
        {"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = 5\n#### 5"}]))
    assert gsm.kind == "generate" and gsm.max_new_tokens == 256
    item = gsm.items[0]
    assert item.contexts == ("Question: Tom has 3 apples and buys 2. How many?\nAnswer:",)
    assert item.shot == item.contexts[0] + " 3 + 2 = 5\n#### 5"
    assert [e.name for e in gsm.extractors] == ["strict-match", "flexible-extract"]


def test_local_formats(tmp_path) -> None:
    mc = load_task(write(tmp_path / "mc.jsonl", [
        {"context": "The sky is", "choices": ["blue", "green"], "answer": 0, "id": "x1"}]))
    assert mc.kind == "multiple_choice" and mc.items[0].continuations == (" blue", " green")
    assert mc.items[0].id == "x1" and mc.items[0].shot == "The sky is blue"
    cloze = load_task(write(tmp_path / "cl.jsonl",
                            [{"context": "Paris is in", "target": " France"}]))
    assert cloze.kind == "cloze" and cloze.items[0].pairs("") == [("Paris is in", " France")]
    gen = load_task(write(tmp_path / "gen.jsonl", [
        {"context": "2 + 2 =", "answer": 4, "stop": ["\n"]}]))
    assert gen.kind == "generate" and gen.items[0].answer == "4"
    assert gen.items[0].stop == ("\n",)
    forced = load_task(str(tmp_path / "gen.jsonl"), task_format="generate")
    assert forced.items == gen.items


def test_format_detection_and_errors(tmp_path) -> None:
    assert detect_format({"ctx_a": "", "endings": []}) == "hellaswag"
    assert detect_format({"question": "q", "answer": "a"}) == "gsm8k"
    assert detect_format({"text": "a b"}) == "lambada"
    with pytest.raises(DataError, match="--task-format"):
        detect_format({"prompt": "x"})
    with pytest.raises(DataError, match="tinylm downloads nothing"):
        load_task("hellaswag")
    with pytest.raises(DataError, match="does not exist"):
        load_task(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["x", "y"], "answer": 0}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        load_task(str(bad))
    with pytest.raises(DataError, match=r"answer must be a choice's index 0\.\.1"):
        load_task(write(tmp_path / "b.jsonl",
                        [{"context": "a", "choices": ["x", "y"], "answer": 2}]))
    with pytest.raises(DataError, match="at least 2 non-empty"):
        load_task(write(tmp_path / "c.jsonl",
                        [{"context": "a", "choices": ["x", ""], "answer": 0}]))
    with pytest.raises(ConfigError, match="--task-format must be one of"):
        load_task(write(tmp_path / "d.jsonl", [{"text": "a b"}]), task_format="nope")
    with pytest.raises(DataError, match="validation split"):
        load_task(write(tmp_path / "hs.jsonl", [{"ctx_a": "a", "ctx_b": "b", "label": "",
                                                 "activity_label": "x", "endings": ["1", "2"]}]))
