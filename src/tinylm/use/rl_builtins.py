"""The built-in RL tasks of ``tinylm rl``: prompts with checkable answers, made in code.

    builtin:arith          "Tom has 3 apples and buys 4 more. How many apples does he
                           have?" -> "7" (add or take away, numbers 1..10)
    builtin:count-letters  "How many times does the letter r appear in 'strawberry'?" -> "3"
                           (one in five asks for a letter the word does not hold: "0")
    builtin:sort           "Sort these numbers from smallest to largest: 5, 2, 9" -> "2, 5, 9"
                           (3 to 5 distinct numbers in 1..20)
    builtin:gsm8k-mini     a two-step GSM8K-style word problem ("... packs of 4 ..., then
                           gives away 5 ...") whose answer must end with "#### N"

How an answer is read from a completion (the chat model answers in its own words):

- arith, count-letters: the LAST number in the completion (digits, an optional minus sign
  and decimals; "7.0" is 7), so "7", "The answer is 7." and "3 + 4 = 7" all read 7.
- sort: the LAST list of two or more numbers separated by commas (", and" or " and" also
  separate), read as "a, b, c": "2, 5, 9", "Sorted: 2, 5 and 9." and "2,5,9" read
  "2, 5, 9".
- gsm8k-mini: lm-evaluation-harness's GSM8K "strict-match" (the first "#### N" of the
  completion, with its rules: commas, "$" and a final "." ignored), as
  ``tinylm.use.task_files.GSM8K`` scores the published GSM8K.

A completion with no answer to read gets ``None`` from :func:`extract` (wrong). Each
task's prompts come from ``random.Random`` seeded with an integer, so a seed gives the
same records on every machine.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from tinylm.use.task_files import GSM8K

RL_BUILTIN_PREFIX = "builtin:"
NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Lucy", "she"), ("Sam", "he"),
         ("Mia", "she"), ("Leo", "he"), ("Emma", "she"))
THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "balloons",
          "coins")
WORDS = ("strawberry banana apple cherry orange lemon mango papaya coconut pineapple "
         "tomato potato carrot pepper onion garlic broccoli spinach letter bottle "
         "mississippi committee balloon coffee address success necessary different "
         "elephant giraffe kangaroo hippopotamus alligator parrot penguin rabbit turtle "
         "butterfly umbrella computer keyboard library hamburger spaghetti chocolate "
         "blueberry raspberry watermelon grape peach pear plum kiwi avocado cucumber "
         "pumpkin mushroom bread cheese butter yellow purple green window mirror pillow "
         "blanket teacher river mountain forest desert island volcano").split()
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_LIST = re.compile(r"-?\d+(?:(?:\s*,\s*(?:and\s+)?|\s+and\s+)-?\d+)+")
_GSM8K_STRICT = GSM8K["extractors"][0]
GSM8K_INSTRUCTION = ("Solve it step by step, then write the final answer on its own line "
                     "as '#### N'.")


def _number(text: str) -> str:
    """A number as its canonical text: "7.0" -> "7", "007" -> "7", "7.5" as it is."""
    whole, _, frac = text.partition(".")
    return text.rstrip("0") if frac.strip("0") else str(int(whole))


def last_number(completion: str) -> str | None:
    """The last number of ``completion`` in canonical form, None if it has none."""
    found = _NUMBER.findall(completion)
    return _number(found[-1]) if found else None


def last_list(completion: str) -> str | None:
    """The last comma-separated list of numbers, as "a, b, c"; None if there is none."""
    found = _LIST.findall(completion)
    if not found:
        return None
    return ", ".join(str(int(n)) for n in re.findall(r"-?\d+", found[-1]))


def gsm8k_answer(completion: str) -> str | None:
    """The "#### N" answer as the harness's GSM8K strict-match reads and normalises it."""
    answer = _GSM8K_STRICT(completion)
    if answer == "[invalid]":
        return None
    for pattern in GSM8K["ignore"]:
        answer = re.sub(pattern, "", answer)
    return answer.lower() if GSM8K["ignore_case"] else answer


def _arith(rnd: random.Random) -> tuple[str, str, dict]:
    (name, he), things = rnd.choice(NAMES), rnd.choice(THINGS)
    kind = rnd.choice(("buys", "gives", "finds"))
    if kind == "gives":
        a = rnd.randint(2, 10)
        b = rnd.randint(1, a - 1)
        prompt = (f"{name} has {a} {things} and gives {b} to a friend. How many {things} "
                  f"does {he} have left?")
        return prompt, str(a - b), {"a": a, "b": b, "op": "-"}
    a, b = rnd.randint(1, 10), rnd.randint(1, 10)
    if kind == "buys":
        prompt = (f"{name} has {a} {things} and buys {b} more. How many {things} does "
                  f"{he} have?")
    else:
        prompt = (f"{name} has {a} {things} and finds {b} more. How many {things} does "
                  f"{he} have now?")
    return prompt, str(a + b), {"a": a, "b": b, "op": "+"}


def _count_letters(rnd: random.Random) -> tuple[str, str, dict]:
    word = rnd.choice(WORDS)
    pool = sorted(set(word)) if rnd.random() < 0.8 else \
        [c for c in ALPHABET if c not in word]
    letter = rnd.choice(pool)
    prompt = f"How many times does the letter {letter} appear in '{word}'?"
    return prompt, str(word.count(letter)), {"word": word, "letter": letter}


def _sort(rnd: random.Random) -> tuple[str, str, dict]:
    numbers = rnd.sample(range(1, 21), rnd.randint(3, 5))
    prompt = "Sort these numbers from smallest to largest: " + ", ".join(map(str, numbers))
    return prompt, ", ".join(map(str, sorted(numbers))), {"numbers": numbers}


def _gsm8k_mini(rnd: random.Random) -> tuple[str, str, dict]:
    (name, he), things = rnd.choice(NAMES), rnd.choice(THINGS)
    kind = rnd.randrange(3)
    a, b = rnd.randint(2, 6), rnd.randint(2, 6)
    if kind == 0:
        c = rnd.randint(1, min(9, a * b - 1))
        answer, steps = a * b - c, f"{a} * {b} = {a * b}. {a * b} - {c} = {a * b - c}."
        text = (f"{name} buys {a} packs of {things} with {b} {things} in each pack, then "
                f"gives away {c}. How many {things} does {he} have left?")
    elif kind == 1:
        c = rnd.randint(1, 9)
        answer, steps = a * b + c, f"{a} * {b} = {a * b}. {a * b} + {c} = {a * b + c}."
        text = (f"{name} has {a} boxes with {b} {things} in each box and {c} loose "
                f"{things}. How many {things} does {he} have in all?")
    else:
        c = rnd.randint(1, 9)
        answer, steps = 2 * a + c, f"{a} + {c} = {a + c}. {a} + {a + c} = {2 * a + c}."
        text = (f"{name} has {a} {things}. A friend has {c} more {things} than {name}. "
                f"How many {things} do they have together?")
    solution = f"{steps}\n#### {answer}"
    return f"{text} {GSM8K_INSTRUCTION}", str(answer), {"solution": solution}


@dataclass(frozen=True)
class Builtin:
    """A built-in task: its record maker, its answer reader, a generation budget."""

    make: Callable[[random.Random], tuple[str, str, dict]]
    extract: Callable[[str], str | None]
    max_new_tokens: int


RL_BUILTINS: dict[str, Builtin] = {
    "arith": Builtin(_arith, last_number, 48),
    "count-letters": Builtin(_count_letters, last_number, 48),
    "sort": Builtin(_sort, last_list, 48),
    "gsm8k-mini": Builtin(_gsm8k_mini, gsm8k_answer, 160),
}
RL_BUILTIN_TASKS = tuple(RL_BUILTIN_PREFIX + name for name in RL_BUILTINS)


__all__ = ["GSM8K_INSTRUCTION", "RL_BUILTINS", "RL_BUILTIN_PREFIX", "RL_BUILTIN_TASKS",
           "Builtin", "gsm8k_answer", "last_list", "last_number"]
