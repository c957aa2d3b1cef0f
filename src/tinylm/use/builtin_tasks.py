"""Built-in tasks, generated in code with a fixed seed: every model has a score, no file.

    builtin:copy          cloze: "Copy exactly: k q x m t r\\nCopy exactly: k q x" -> " m t r"
    builtin:count         cloze: "Count: 14, 15, 16, 17," -> " 18"
    builtin:brackets      multiple choice: which bracket closes "Close the bracket: ( [ ] {" ->
                          ")" "]" "}" ">" (the innermost open one)
    builtin:add-digits    generate: "Question: What is 17 + 25?\\nAnswer:" -> "42" (the last
                          number of the greedy answer, up to a new line)
    builtin:add-words     multiple choice: "Question: What is three plus four?\\nAnswer:"
                          -> four number words up to twenty, " seven" among them

Each task has ITEMS scored items and its own train split of TRAIN_ITEMS (another seed,
none with the context of a scored item) that few-shot examples come from. The same seed
gives the same items on every machine (``random.Random`` seeded with an integer).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinylm.core.errors import ConfigError
from tinylm.use.tasks import Extractor, Item, Task

BUILTIN_PREFIX = "builtin:"
ITEMS = 100
TRAIN_ITEMS = 20
SEED = 31
LETTERS = "bcdfghjkmnpqrstvwxz"
NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve "
                "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty").split()
BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">"}


def _copy(rnd: random.Random) -> Item:
    seq = [rnd.choice(LETTERS) for _ in range(rnd.randint(5, 8))]
    cut = len(seq) - 3
    context = f"Copy exactly: {' '.join(seq)}\nCopy exactly: {' '.join(seq[:cut])}"
    target = " " + " ".join(seq[cut:])
    return Item((context,), (target,), 0, shot=context + target)


def _count(rnd: random.Random) -> Item:
    start = rnd.randint(1, 500)
    context = "Count: " + ", ".join(str(start + i) for i in range(4)) + ","
    target = f" {start + 4}"
    return Item((context,), (target,), 0, shot=context + target)


def _brackets(rnd: random.Random) -> Item:
    opened: list[str] = []
    shown: list[str] = []
    for _ in range(rnd.randint(3, 7)):
        if opened and rnd.random() < 0.35:
            shown.append(BRACKETS[opened.pop()])
        else:
            opened.append(rnd.choice(list(BRACKETS)))
            shown.append(opened[-1])
    if not opened:
        opened.append(rnd.choice(list(BRACKETS)))
        shown.append(opened[-1])
    choices = list(BRACKETS.values())
    answer = choices.index(BRACKETS[opened[-1]])
    context = f"Close the bracket: {' '.join(shown)}"
    return Item((context,), tuple(" " + c for c in choices), answer, tuple(choices),
                shot=context + " " + choices[answer])


def _add_digits(rnd: random.Random) -> Item:
    a, b = rnd.randint(10, 49), rnd.randint(10, 49)  # two digits each: one length, one batch
    context = f"Question: What is {a} + {b}?\nAnswer:"
    return Item((context,), (), str(a + b), shot=f"{context} {a + b}")


def _add_words(rnd: random.Random) -> Item:
    a, b = rnd.randint(0, 10), rnd.randint(0, 10)
    total = a + b
    others = rnd.sample([n for n in range(len(NUMBER_WORDS)) if n != total], 3)
    values = sorted([total, *others])
    choices = [NUMBER_WORDS[n] for n in values]
    context = f"Question: What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?\nAnswer:"
    return Item((context,), tuple(" " + c for c in choices), values.index(total),
                tuple(choices), shot=f"{context} {NUMBER_WORDS[total]}")


_MAKERS: dict[str, tuple[str, Callable[[random.Random], Item], dict]] = {
    "copy": ("cloze", _copy, {}),
    "count": ("cloze", _count, {}),
    "brackets": ("multiple_choice", _brackets, {}),
    "add-digits": ("generate", _add_digits,
                   {"stop": ("\n",), "max_new_tokens": 12,
                    "extractors": (Extractor("exact_match", "(-?[0-9]+)", -1),)}),
    "add-words": ("multiple_choice", _add_words, {}),
}
BUILTIN_TASKS = tuple(BUILTIN_PREFIX + name for name in _MAKERS)


def builtin_task(spec: str, *, seed: int = SEED, items: int = ITEMS) -> Task:
    """The built-in task ``builtin:NAME``: ``items`` scored items from ``seed`` and a
    train split of :data:`TRAIN_ITEMS` from another seed."""
    name = spec[len(BUILTIN_PREFIX):] if spec.startswith(BUILTIN_PREFIX) else spec
    if name not in _MAKERS:
        raise ConfigError(f"no built-in task {spec!r}; the built-in tasks are "
                          f"{', '.join(BUILTIN_TASKS)}")
    kind, make, settings = _MAKERS[name]
    index = list(_MAKERS).index(name)
    test = random.Random(seed * 1000 + 2 * index)
    train = random.Random(seed * 1000 + 2 * index + 1)
    scored = [make(test) for _ in range(items)]
    seen = {it.contexts for it in scored}
    shots: list[Item] = []
    while len(shots) < TRAIN_ITEMS:  # the train split never repeats a scored item
        it = make(train)
        if it.contexts not in seen:
            shots.append(it)
    return Task(BUILTIN_PREFIX + name, kind, scored, shots, **settings)


__all__ = ["BUILTIN_PREFIX", "BUILTIN_TASKS", "builtin_task"]
