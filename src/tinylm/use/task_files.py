"""Task files: tinylm's local JSONL per kind and the published JSONL formats.

Local formats (one JSON object a line, docs/evaluate.md):

    multiple choice   {"context": str, "choices": [str, ...], "answer": int}   (+ "id")
                      each continuation is " " + choice (the harness's target delimiter)
    cloze             {"context": str, "target": str}   the target as it follows the
                      context, leading space included (" Paris")
    generate          {"context": str, "answer": str, "stop": [str] (optional)}

Published formats, as their JSONL files come from their sources or a Hugging Face
``datasets`` export (``to_json``), each turned into items exactly as the harness's task
YAML does: HellaSwag (``ctx_a``/``endings``), ARC Easy/Challenge (``answerKey``), PIQA
(``goal``/``sol1``; the original files keep labels in ``NAME-labels.lst`` beside them),
Winogrande (``option1``/``sentence``), BoolQ (``passage``/``question``), LAMBADA
(``text``) and GSM8K (``question``/``answer`` with "#### N"). The format is found from
the first record's fields, or named with ``task_format``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinylm.core.errors import ConfigError, DataError
from tinylm.use.builtin_tasks import BUILTIN_PREFIX, builtin_task
from tinylm.use.tasks import Extractor, Item, Task

#: The published tasks tinylm reads, by the names people use for them.
PUBLISHED = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq",
             "lambada", "gsm8k")
FORMATS = ("mc", "cloze", "generate", "hellaswag", "arc", "piqa", "winogrande", "boolq",
           "lambada", "gsm8k")
#: The largest task file read (HellaSwag's validation split is ~50 MB).
TASK_MAX_BYTES = 1 << 30


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-empty line of a JSONL file."""
    try:
        if path.stat().st_size > TASK_MAX_BYTES:
            raise DataError(f"task file {path} is larger than {TASK_MAX_BYTES >> 20} MB")
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise DataError(f"task file {path} does not exist; pass a JSONL file (docs/"
                        f"evaluate.md) or a built-in task such as builtin:copy") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read task file {path} as UTF-8 text ({exc})") from exc
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{n}: not a JSON object ({exc.msg}); a task file holds "
                            f"one JSON object a line") from exc
        if not isinstance(record, dict):
            raise DataError(f"{path}:{n}: not a JSON object; a task file holds one JSON "
                            f"object a line")
        out.append((n, record))
    if not out:
        raise DataError(f"task file {path} has no records")
    return out


def detect_format(record: dict[str, Any]) -> str:
    """The format of a task file, from the fields of its first record."""
    keys = set(record)
    rules = [("hellaswag", {"ctx_a", "endings"}), ("arc", {"answerKey"}),
             ("piqa", {"goal", "sol1"}), ("winogrande", {"sentence", "option1"}),
             ("boolq", {"passage", "question"}), ("mc", {"context", "choices"}),
             ("cloze", {"context", "target"}), ("generate", {"context", "answer"}),
             ("gsm8k", {"question", "answer"}), ("lambada", {"text"})]
    for name, needed in rules:
        if needed <= keys:
            return name
    raise DataError(f"cannot tell the task format from the fields {sorted(keys)}; use the "
                    f"local formats of docs/evaluate.md or name one with --task-format "
                    f"({', '.join(FORMATS)})")


def _need(record: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = record.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataError(f"{where}: field {key!r} must be a {want}, got {value!r}")
    return value


def _mc(context: str, choices: list[str], answer: Any, where: str, *, delimiter: str = " ",
        id: Any = None) -> Item:
    """A multiple-choice item whose continuations are delimiter + choice."""
    if not isinstance(choices, list) or len(choices) < 2 or \
            not all(isinstance(c, str) and c for c in choices):
        raise DataError(f"{where}: 'choices' must be a list of at least 2 non-empty strings")
    if not isinstance(answer, int) or isinstance(answer, bool) or \
            not 0 <= answer < len(choices):
        raise DataError(f"{where}: the answer must be a choice's index 0..{len(choices) - 1}, "
                        f"got {answer!r}")
    return Item((context,), tuple(delimiter + c for c in choices), answer, tuple(choices),
                shot=context + delimiter + choices[answer],
                id=None if id is None else str(id))


def _local_mc(r: dict[str, Any], where: str) -> Item:
    return _mc(_need(r, "context", str, where), r.get("choices"), r.get("answer"), where,
               id=r.get("id"))


def _local_cloze(r: dict[str, Any], where: str) -> Item:
    context, target = _need(r, "context", str, where), _need(r, "target", str, where)
    if not target:
        raise DataError(f"{where}: 'target' is empty")
    return Item((context,), (target,), 0, shot=context + target, id=r.get("id"))


def _local_generate(r: dict[str, Any], where: str) -> Item:
    context = _need(r, "context", str, where)
    answer = _need(r, "answer", (str, int, float), where)
    stop = r.get("stop")
    if stop is not None and (not isinstance(stop, list) or
                             not all(isinstance(s, str) and s for s in stop)):
        raise DataError(f"{where}: 'stop' must be a list of non-empty strings")
    return Item((context,), (), str(answer), shot=context + " " + str(answer),
                stop=None if stop is None else tuple(stop), id=r.get("id"))


def _hellaswag_text(text: str) -> str:
    """The harness's HellaSwag preprocess (WikiHow's bracket artefacts removed)."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _label(value: Any, where: str, what: str = "label") -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: no usable {what} ({value!r}); a test split without labels "
                        f"cannot be scored, use the validation split") from exc


def _hellaswag(r: dict[str, Any], where: str) -> Item:
    ctx = _need(r, "ctx_a", str, where) + " " + str(r.get("ctx_b", "")).capitalize()
    query = _hellaswag_text(str(r.get("activity_label", "")) + ": " + ctx)
    endings = [_hellaswag_text(e) for e in _need(r, "endings", list, where)]
    return _mc(query, endings, _label(r.get("label"), where), where, id=r.get("ind"))


def _arc(r: dict[str, Any], where: str) -> Item:
    q = r.get("question")
    if isinstance(q, dict):  # the AI2 original: {"stem", "choices": [{"text", "label"}]}
        texts = [c.get("text") for c in q.get("choices", [])]
        labels = [c.get("label") for c in q.get("choices", [])]
        q = q.get("stem")
    else:  # the Hugging Face export: "choices": {"text": [...], "label": [...]}
        choices = r.get("choices") if isinstance(r.get("choices"), dict) else {}
        texts, labels = choices.get("text", []), choices.get("label", [])
    if not isinstance(q, str) or r.get("answerKey") not in labels:
        raise DataError(f"{where}: an ARC record needs a question and an answerKey among its "
                        f"choices' labels")
    return _mc(f"Question: {q}\nAnswer:", texts, labels.index(r["answerKey"]), where,
               id=r.get("id"))


def _piqa(r: dict[str, Any], where: str) -> Item:
    goal = _need(r, "goal", str, where)
    choices = [_need(r, "sol1", str, where), _need(r, "sol2", str, where)]
    return _mc(f"Question: {goal}\nAnswer:", choices, _label(r.get("label"), where), where)


def _winogrande(r: dict[str, Any], where: str) -> Item:
    sentence = _need(r, "sentence", str, where)
    if "_" not in sentence:
        raise DataError(f"{where}: a Winogrande sentence needs the blank '_'")
    idx = sentence.index("_")
    contexts = tuple(sentence[:idx] + _need(r, k, str, where) for k in ("option1", "option2"))
    answer = {"1": 0, "2": 1}.get(str(r.get("answer")))
    if answer is None:
        raise DataError(f"{where}: no usable answer ({r.get('answer')!r}, want \"1\" or "
                        f"\"2\"); a test split without labels cannot be scored")
    target = sentence[idx + 1:].strip()
    return Item(contexts, (" " + target,) * 2, answer, contexts,
                shot=contexts[answer] + " " + target, id=r.get("qID"))


def _boolq(r: dict[str, Any], where: str) -> Item:
    label = r.get("label", r.get("answer"))  # SuperGLUE: label 0/1; Google's: answer bool
    context = (f"{_need(r, 'passage', str, where)}\nQuestion: "
               f"{_need(r, 'question', str, where)}?\nAnswer:")
    return _mc(context, ["no", "yes"], _label(label, where), where, id=r.get("idx"))


def _lambada(r: dict[str, Any], where: str) -> Item:
    text = _need(r, "text", str, where)
    words = text.split(" ")
    if len(words) < 2 or not words[-1]:
        raise DataError(f"{where}: a LAMBADA text needs words before its last word")
    context, target = " ".join(words[:-1]), " " + words[-1]
    return Item((context,), (target,), 0, shot=context + target)


def _gsm8k(r: dict[str, Any], where: str) -> Item:
    question, answer = _need(r, "question", str, where), _need(r, "answer", str, where)
    context = f"Question: {question}\nAnswer:"
    return Item((context,), (), answer, shot=context + " " + answer)


READERS: dict[str, Callable[[dict[str, Any], str], Item]] = {
    "mc": _local_mc, "cloze": _local_cloze, "generate": _local_generate,
    "hellaswag": _hellaswag, "arc": _arc, "piqa": _piqa, "winogrande": _winogrande,
    "boolq": _boolq, "lambada": _lambada, "gsm8k": _gsm8k}
KIND_OF = {"mc": "multiple_choice", "cloze": "cloze", "lambada": "cloze",
           "generate": "generate", "gsm8k": "generate"}
#: GSM8K as the harness scores it: two answer extractors, its regexes to ignore.
GSM8K = {"stop": ("Question:", "</s>", "<|im_end|>"), "max_new_tokens": 256,
         "ignore": (",", "\\$", "(?s).*#### ", "\\.$"), "ignore_case": True,
         "extractors": (Extractor("strict-match", "#### (\\-?[0-9\\.\\,]+)", 0),
                        Extractor("flexible-extract", "(-?[$0-9.,]{2,})|(-?[0-9]+)", -1))}


def _piqa_labels(path: Path, records: list[tuple[int, dict[str, Any]]]) -> None:
    """Fill PIQA's labels from NAME-labels.lst beside NAME.jsonl (the original release)."""
    if all("label" in r for _, r in records):
        return
    lst = path.with_name(path.stem + "-labels.lst")
    if not lst.is_file():
        raise DataError(f"{path} has PIQA records without labels and no {lst.name} beside "
                        f"it; pass the split with its labels (train or valid)")
    labels = lst.read_text(encoding="utf-8").split()
    if len(labels) != len(records):
        raise DataError(f"{lst} has {len(labels)} labels for {len(records)} records in "
                        f"{path.name}")
    for (_, r), label in zip(records, labels, strict=True):
        r.setdefault("label", label)


def read_items(path: str | os.PathLike, task_format: str | None = None
               ) -> tuple[str, list[Item]]:
    """(format, items) of a task file."""
    path = Path(path)
    records = read_jsonl(path)
    fmt = task_format or detect_format(records[0][1])
    if fmt not in READERS:
        raise ConfigError(f"--task-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "piqa":
        _piqa_labels(path, records)
    reader = READERS[fmt]
    return fmt, [reader(r, f"{path}:{n}") for n, r in records]


def load_task(spec: str, *, task_format: str | None = None,
              fewshot_file: str | os.PathLike | None = None, name: str | None = None) -> Task:
    """The task ``spec`` names: ``builtin:NAME`` or a JSONL file (its name: the file's
    stem). ``fewshot_file``: the split few-shot examples come from (same format)."""
    if spec.startswith(BUILTIN_PREFIX):
        task = builtin_task(spec)
        if fewshot_file is not None:
            raise ConfigError("a built-in task brings its own few-shot split; drop "
                              "--fewshot-file")
        return task
    if spec.lower() in PUBLISHED and not Path(spec).exists():
        raise DataError(f"{spec} needs its file: download its JSONL (e.g. with the datasets "
                        f"package, then to_json) and pass --task path/to/{spec}.jsonl; "
                        f"tinylm downloads nothing")
    fmt, items = read_items(spec, task_format)
    fewshot = None
    if fewshot_file is not None:
        _, fewshot = read_items(fewshot_file, fmt)
    settings: dict[str, Any] = dict(GSM8K) if fmt == "gsm8k" else {}
    return Task(name or Path(spec).stem, KIND_OF.get(fmt, "multiple_choice"), items, fewshot,
                extra={"format": fmt}, **settings)


__all__ = ["FORMATS", "PUBLISHED", "detect_format", "load_task", "read_items", "read_jsonl"]
