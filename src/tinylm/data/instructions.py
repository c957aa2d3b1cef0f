"""A built-in instruction set that needs no download: the interpreter's own docs as Q/A.

``python-qa`` turns documentation every CPython install carries into question/answer
conversations (a few thousand, the same on every run of one Python version):

* built-in functions and types: "What does the built-in function len do?" -> the first
  paragraph of its docstring;
* methods of str, list, dict, set, bytes and int: "What does str.split do?";
* functions and classes of common standard-library modules (math, os.path, json, re,
  itertools, ...): "What does math.gcd do?", and "What is the json module for?";
* the reference topics of ``pydoc_data.topics`` ("Explain the assert statement.").

Each answer is the documentation's first paragraph with whitespace normalised, cut at
a sentence end to at most ``max_answer_chars``. :data:`HELD_OUT` names a few subjects
left out of the set, so a demo can ask questions the model never saw answered.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path

from tinylm.core.display import display_name
from tinylm.core.errors import DataError

NAME = "python-qa"
MODULES = ("math", "os", "os.path", "json", "re", "string", "random", "itertools",
           "functools", "collections", "shutil", "textwrap", "statistics", "operator",
           "heapq", "bisect", "glob", "fnmatch", "copy", "time", "base64", "binascii",
           "hashlib", "zlib", "struct", "keyword", "calendar", "difflib", "pathlib",
           "fractions", "decimal", "cmath", "contextlib", "html", "csv", "secrets")
TYPES = (str, list, dict, set, bytes, int, float, tuple, frozenset)
#: Subjects kept out of the set (questions about them are held out for demos).
HELD_OUT = ("abs", "str.upper", "math.gcd", "os.path.basename", "list.reverse")
_TEMPLATES = {
    "builtin": ("What does the built-in function {name} do?", "Explain {name}() in Python.",
                "What is {name} used for?"),
    "method": ("What does {name} do?", "Explain the {name} method.",
               "What is {name} used for?"),
    "function": ("What does {name} do?", "What is {name} in Python?", "Explain {name}."),
    "module": ("What is the {name} module for?", "Explain the {name} module."),
    "topic": ("Explain {name} in Python.", "What should I know about {name}?"),
}


def _first_paragraph(doc: str | None, limit: int) -> str:
    """The first paragraph that is prose (not a bare signature), whitespace normalised,
    cut at the last sentence end within ``limit`` characters; "" if none."""
    if not doc:
        return ""
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        if re.search(r"[*=~^-]{4,}", para):
            continue  # a reST title and its underline
        text = " ".join(para.split())
        if len(text) < 20 or re.fullmatch(r"[\w.]+\(.*\)( -> .*)?", text):
            continue  # a signature line such as "len(obj, /)"
        if len(text) <= limit:
            return text
        cut = max(text.rfind(". ", 0, limit), text.rfind(".\n", 0, limit))
        return text[:cut + 1] if cut > limit // 3 else ""
    return ""


def _subjects() -> Iterator[tuple[str, str, str | None]]:
    """(kind, name, docstring) of every documented subject, in a fixed order."""
    import builtins

    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if not name.startswith("_") and callable(obj) and not (
                isinstance(obj, type) and issubclass(obj, BaseException)):
            yield "builtin", name, obj.__doc__
    for cls in TYPES:
        for name in sorted(vars(cls)):
            if not name.startswith("_"):
                yield "method", f"{cls.__name__}.{name}", getattr(cls, name).__doc__
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        yield "module", mod_name, mod.__doc__
        for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, name, None)
            if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            yield "function", f"{mod_name}.{name}", obj.__doc__
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for name in sorted(topics):
        title = name.replace("-", " ")
        subject = f"the {title} statement" if name in _STATEMENTS else title
        yield "topic", subject, topics[name]


_STATEMENTS = {"assert", "assignment", "break", "continue", "del", "for", "global", "if",
               "import", "nonlocal", "pass", "raise", "return", "try", "while", "with"}


def _items(max_answer_chars: int, held_out: bool
           ) -> Iterator[tuple[str, list[dict[str, str]]]]:
    seen = set()
    for kind, name, doc in _subjects():
        answer = _first_paragraph(doc, max_answer_chars)
        if not answer or (kind, name) in seen or (name in HELD_OUT) != held_out:
            continue
        seen.add((kind, name))
        for template in _TEMPLATES[kind]:
            yield name, [{"role": "user", "content": template.format(name=name)},
                         {"role": "assistant", "content": answer}]


def conversations(max_answer_chars: int = 240, held_out: bool = False
                  ) -> list[list[dict[str, str]]]:
    """The instruction set as chat messages; ``held_out=True`` gives only the
    conversations about :data:`HELD_OUT` subjects instead."""
    return [messages for _, messages in _items(max_answer_chars, held_out)]


def held_out_questions(max_answer_chars: int = 240) -> list[tuple[str, str]]:
    """(question, the documentation's answer), one per held-out subject."""
    questions: dict[str, tuple[str, str]] = {}
    for name, messages in _items(max_answer_chars, True):
        questions.setdefault(name, (messages[0]["content"], messages[1]["content"]))
    return list(questions.values())


def write_jsonl(path: str | Path, max_answer_chars: int = 240) -> Path:
    """Write the instruction set as ``{"messages": [...]}`` lines to ``path``."""
    path = Path(path)
    try:
        with path.open("w", encoding="utf-8") as f:
            for messages in conversations(max_answer_chars):
                f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    except OSError as exc:
        raise DataError(f"cannot write {display_name(path)}: {exc.strerror}") from exc
    return path


__all__ = ["HELD_OUT", "NAME", "conversations", "held_out_questions", "write_jsonl"]
