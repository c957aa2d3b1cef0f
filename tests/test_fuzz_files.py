"""Issue #32 item 5: a fuzz campaign over the files a user hands tinylm.

At least 1,000 fuzzed ``tokenizer.json``, ``config.json`` and chat JSONL files, made
from real ones by hypothesis (a subtree replaced by random JSON of any shape and type,
huge numbers, NaN, a key dropped, bytes truncated or flipped, invalid UTF-8, deep
nesting) and loaded through the public paths (``load_tokenizer`` then an encode and a
decode; ``io.checkpoint.read_config`` then ``ModelConfig``/``TrainConfig.from_dict``;
``chat.read_records`` then ``render_with_mask``; a tokenizer folder's
``tokenizer_config.json`` and its chat template, rendered), end in a :class:`TinyLMError` of one
line or load, never in another exception. Derandomized (the same files every run) and
bounded: 1,200 files, about 15 s here.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinylm.core.config import ModelConfig, TrainConfig
from tinylm.core.errors import TinyLMError
from tinylm.core.model import GPT
from tinylm.data.chat import read_records, render_with_mask
from tinylm.data.tokenizer_files import load_tokenizer
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer, CharTokenizer
from tinylm.io.checkpoint import read_config
from tinylm.io.checkpoint_files import save_checkpoint

EXAMPLES = 300  # per kind of file (each test asserts it ran them): 1,200 in all
COUNTS: dict[str, int] = {}

_CORPUS = ["hello world, the quick brown fox", "ünïcödé 日本語 text", "def f(x):\n    return x"]
_BPE = BPETokenizer.train(_CORPUS * 4, vocab_size=300, special_tokens=STANDARD_SPECIALS)
BASE_TOKENIZERS = [CharTokenizer("".join(_CORPUS), special_tokens=STANDARD_SPECIALS).to_hf_json(),
                   _BPE.to_hf_json()]
BASE_CHATS = [
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "what is len?"},
                  {"role": "assistant", "content": "the length"}]},
    {"prompt": "2 + 2?", "completion": "4"},
    {"instruction": "add", "input": "1 and 2", "output": "3"},
]


def _settings() -> Any:
    return settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# --- strategies ----------------------------------------------------------------------------

_NUMBERS = st.one_of(
    st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30, 10**400, -10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -0.0, 1e-320]),
)
_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(
    ["", "\ud800", "<|end|>", "user", "assistant", "BPE", "ByteLevel", "model", "a" * 300]))
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``value`` (dict keys, list indexes), itself first."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:40]):  # a long vocabulary: its first entries
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: Any, path: tuple, new: Any, drop: bool) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    if drop and not rest:
        del copy[head]
    else:
        copy[head] = _replace(value[head], rest, new, drop)
    return copy


def _dumps(value: Any, ascii: bool) -> bytes:
    """JSON bytes; a lone surrogate becomes ``\\ud800`` (``ascii``: valid JSON, which
    json.loads takes) or its raw bytes (invalid UTF-8)."""
    return json.dumps(value, ensure_ascii=ascii).encode("utf-8", "surrogatepass")


@st.composite
def fuzzed(draw: Any, bases: list[Any]) -> bytes:
    """A real document mutated: subtrees replaced or dropped, then perhaps its bytes
    damaged (truncated, a byte flipped, invalid UTF-8 spliced in) or deeply nested."""
    doc = draw(st.sampled_from(bases))
    for _ in range(draw(st.integers(0, 3))):
        paths = _paths(doc)
        path = paths[draw(st.integers(0, len(paths) - 1))]
        doc = _replace(doc, path, draw(JSON), drop=bool(path) and draw(st.booleans()))
    data = _dumps(doc, draw(st.booleans()))
    damage = draw(st.sampled_from(["none"] * 5 + ["truncate", "flip", "utf8", "nest", "raw"]))
    if damage == "truncate":
        data = data[:draw(st.integers(0, len(data)))]
    elif damage == "flip":
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    elif damage == "utf8":
        i = draw(st.integers(0, len(data)))
        data = data[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) \
            + data[i:]
    elif damage == "nest":
        depth = draw(st.sampled_from([65, 200, 5000, 100_000]))
        data = b"[" * depth + data + b"]" * depth
    elif damage == "raw":
        data = draw(st.binary(max_size=64))
    return data


def _one_line(exc: TinyLMError) -> None:
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message, message


def _count(kind: str) -> None:
    COUNTS[kind] = COUNTS.get(kind, 0) + 1


# --- the campaign --------------------------------------------------------------------------


def test_fuzzed_tokenizer_files_load_or_fail_in_one_line() -> None:
    folder = Path(tempfile.mkdtemp(prefix="fuzz-tok-"))
    path = folder / "tokenizer.json"

    @_settings()
    @given(fuzzed(BASE_TOKENIZERS))
    def run(data: bytes) -> None:
        _count("tokenizer")
        path.write_bytes(data)
        try:
            tok = load_tokenizer(path)
            ids = tok.encode("hello wörld <|end|>")
            tok.decode(ids)
            assert tok.vocab_size > 0
        except TinyLMError as exc:
            _one_line(exc)
    run()
    assert COUNTS["tokenizer"] >= EXAMPLES


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BASE_SETTINGS = [{"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
                  "add_bos_token": False, "pad_token": "<|endoftext|>",
                  "model_max_length": 2048}]
#: pieces of templates spliced into a chat template: syntax errors, undefined names,
#: runtime errors, the sandbox's refusals, raise_exception
_TEMPLATE_BITS = ["{{", "{% if %}", "{% endfor %}", "{{ messages[99]['content'] }}",
                  "{{ 1 / 0 }}", "{{ raise_exception('no') }}", "{{ m.__class__ }}",
                  "{{ ''.__class__.__mro__ }}", "{% for x in range(10**12) %}x{% endfor %}",
                  "{{ messages | tojson }}", "{{ bos_token + 1 }}", "{% set ns = namespace(a=1) %}"
                  "{% set ns.__x = 2 %}", "{{ strftime_now('%Y') }}", "{% generation %}x"
                  "{% endgeneration %}", "\x00", "{{ m['content'] | upper }}"]


@st.composite
def fuzzed_settings(draw: Any) -> bytes:
    """A tokenizer_config.json: the real one mutated, or its template spliced with bits."""
    if draw(st.booleans()):
        return draw(fuzzed(BASE_SETTINGS))
    template = CHATML
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(template)))
        template = template[:i] + draw(st.sampled_from(_TEMPLATE_BITS)) + template[i:]
    return _dumps({**BASE_SETTINGS[0], "chat_template": template}, draw(st.booleans()))


def test_fuzzed_tokenizer_configs_and_templates_load_or_fail_in_one_line() -> None:
    from tinylm.data.chat import render_chat

    folder = Path(tempfile.mkdtemp(prefix="fuzz-cfg-"))
    _BPE.with_special_tokens(["<|im_start|>", "<|im_end|>"]).save(folder / "tokenizer.json")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]

    @_settings()
    @given(fuzzed_settings())
    def run(data: bytes) -> None:
        _count("tokenizer_config")
        (folder / "tokenizer_config.json").write_bytes(data)
        try:
            tok = load_tokenizer(folder)
            ids = render_chat(tok, messages)
            assert all(0 <= i < tok.vocab_size for i in ids)
            render_with_mask(tok, messages)
        except TinyLMError as exc:
            _one_line(exc)
    run()
    assert COUNTS["tokenizer_config"] >= EXAMPLES


@pytest.fixture(scope="module")
def checkpoint() -> tuple[Path, dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(prefix="fuzz-ckpt-")) / "ckpt"
    cfg = ModelConfig(vocab_size=64, context_length=16, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    save_checkpoint(folder, GPT(cfg), extra_config={"train": TrainConfig().to_dict()})
    return folder, json.loads((folder / "config.json").read_text())


def test_fuzzed_checkpoint_configs_read_or_fail_in_one_line(checkpoint) -> None:
    folder, base = checkpoint

    @_settings()
    @given(fuzzed([base]))
    def run(data: bytes) -> None:
        _count("config")
        (folder / "config.json").write_bytes(data)
        try:
            config = read_config(folder)
            model = ModelConfig.from_dict(config["model"])
            assert model.n_layer >= 1
            if "train" in config:
                TrainConfig.from_dict(config["train"])
        except TinyLMError as exc:
            _one_line(exc)
    run()
    assert COUNTS["config"] >= EXAMPLES


def test_fuzzed_chat_files_read_or_fail_in_one_line() -> None:
    folder = Path(tempfile.mkdtemp(prefix="fuzz-chat-"))
    path = folder / "chat.jsonl"

    @_settings()
    @given(st.lists(fuzzed(BASE_CHATS), min_size=1, max_size=4))
    def run(lines: list[bytes]) -> None:
        _count("chat")
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
        try:
            for _, _, item in read_records([path], max_record_bytes=1 << 16):
                if isinstance(item, list):
                    ids, mask = render_with_mask(_BPE, item)
                    assert len(ids) == len(mask) and math.isfinite(sum(mask))
                else:
                    assert "\n" not in str(item)
        except TinyLMError as exc:
            _one_line(exc)
    run()
    assert COUNTS["chat"] >= EXAMPLES
