"""Built-in corpora that need no download, and a generator of large test corpora.

``python-docs`` is the interpreter's own reference documentation
(``pydoc_data.topics``, about 465 K characters of English prose and code), which
every CPython install carries, so ``tinylm prepare`` works with no input at all.
Register more named corpora in :data:`CORPORA`.

:func:`write_synthetic` writes an arbitrarily large corpus of real-looking text
(shuffled python-docs paragraphs with some Japanese lines) for tests and benchmarks;
:func:`synthetic_documents` yields the same kind of text as separate documents.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tinylm.core.errors import DataError


@dataclass(frozen=True)
class Corpus:
    """A named text that ships with Python or tinylm."""

    name: str
    description: str
    load: Callable[[], str]


def _python_docs() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise DataError(
            "the built-in corpus python-docs needs the standard library's pydoc_data "
            "package, which this Python install lacks; install your distribution's full "
            "Python package or pass --input FILE"
        ) from exc
    # Sorted topic names give the same text on every run of one Python version.
    return "\n\n".join(topics[name].strip("\n") for name in sorted(topics)) + "\n"


CORPORA: dict[str, Corpus] = {
    "python-docs": Corpus(
        "python-docs",
        "the Python interpreter's reference documentation (pydoc_data.topics), ~465 K chars",
        _python_docs,
    ),
}


def corpus_names() -> list[str]:
    return sorted(CORPORA)


def load_corpus(name: str) -> str:
    """The full text of the built-in corpus ``name``."""
    corpus = CORPORA.get(name)
    if corpus is None:
        raise DataError(f"unknown corpus {name!r}; built-in corpora: {', '.join(corpus_names())}")
    return corpus.load()


_JAPANESE = [
    "注意機構は、クエリとキーの内積から重みを計算し、値の加重平均を返す。",
    "言語モデルは次のトークンの確率分布を予測する。",
    "東京の天気は晴れ、気温は二十三度です。🌤️",
    "カタカナ、ひらがな、漢字が混ざった文章もそのまま扱える。",
]


def synthetic_documents(n_bytes: int, seed: int = 0, paragraphs: int = 8,
                        text: str | None = None) -> Iterator[str]:
    """Documents of ``paragraphs`` random paragraphs (python-docs, or those of ``text``,
    with about one Japanese line in twenty paragraphs) until ``n_bytes`` of UTF-8 in all.
    Deterministic for a given seed; one document is held at a time."""
    source = text if text is not None else load_corpus("python-docs")
    pool = [p for p in source.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    written = 0
    while written < n_bytes:
        doc = []
        for _ in range(paragraphs):
            doc.append(rng.choice(pool))
            if rng.random() < 0.05:
                doc.append(rng.choice(_JAPANESE))
        text_out = "\n\n".join(doc)
        written += len(text_out.encode("utf-8"))
        yield text_out


def write_synthetic(path: str | Path, n_bytes: int, seed: int = 0) -> Path:
    """Write at least ``n_bytes`` of UTF-8 text: shuffled python-docs paragraphs with
    about one Japanese line in twenty paragraphs. Deterministic for a given seed."""
    paragraphs = [p for p in load_corpus("python-docs").split("\n\n") if p.strip()]
    rng = random.Random(seed)
    path = Path(path)
    written = 0
    with open(path, "wb") as f:
        while written < n_bytes:
            block = []
            for _ in range(2000):
                block.append(rng.choice(paragraphs))
                if rng.random() < 0.05:
                    block.append(rng.choice(_JAPANESE))
            data = ("\n\n".join(block) + "\n\n").encode("utf-8")
            f.write(data)
            written += len(data)
    return path
