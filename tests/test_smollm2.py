"""The real SmolLM2-135M-Instruct (Q4_1 GGUF) proven against transformers and llama.cpp.

- **transformers is the exact oracle**: it dequantizes the same file to the same float32
  weights, so tinylm's logits on real text (English prose and Python, rendered through
  the model's own chat template by tinylm's tokenizer) agree within 1e-4 (measured on CPU:
  bit-identical), and greedy answers of ``tinylm chat`` (the CLI's own code path,
  :class:`ChatSession`) equal ``generate(do_sample=False)`` token for token on
  ``apply_chat_template`` ids.
- **llama.cpp is close, not equal**: it multiplies the Q4_1 weights by activations
  quantized to 8 bits (Q8_1 blocks), so its logits differ. Measured over the 624 positions
  of :data:`CONVERSATION` (tinylm's ids fed to both): top-1 agreement 0.970 (605 of 624),
  max |logit error| 1.46, mean 0.17 (asserted: >= 0.95, < 2.5, < 0.25); every one of the
  19 disagreements is where tinylm's top two logits are within 0.16 of each other.
- **"What is the capital of France?"**: llama.cpp's ``create_chat_completion`` renders the
  same prompt (the same 37 ids as tinylm and transformers); the answers differ by the
  arithmetic. The first answer token is a near-tie: tinylm (= transformers) has "The"
  25.325 over "L" 25.243 (gap 0.08 logits), llama.cpp "L" 24.740 over "The" 24.651
  (gap 0.09). Greedy llama.cpp (``temperature=0``) thus starts "L'Étoile, la Cité, ..."
  while tinylm and transformers answer "The capital of France is Paris."; llama.cpp's
  default sampling (temperature 0.2, top-k 40, top-p 0.95, min-p 0.05) picks between the
  near-tied first tokens, so its answer changes with the seed. Given "The", llama.cpp
  continues exactly as tinylm does.

docs/models.md ("How close is tinylm to transformers and llama.cpp on SmolLM2") says the
same for people.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tinylm.data.chat import render_chat, stop_ids
from tinylm.io.checkpoint import load_model, require_tokenizer_of, resolve_checkpoint_dir
from tinylm.io.gguf_checkpoint import load_gguf
from tinylm.use import chatsession

FRANCE = "What is the capital of France?"
QUESTIONS = [FRANCE, "What is the capital of Japan?",
             "Write a Python function that returns the square of a number.",
             "How do I reverse a list in Python?"]
ANSWER_TOKENS = 40
_GENERATE_STREAM = chatsession.generate_stream  # the real one, before any test's spy

PROSE = (
    "A language model reads a text as a sequence of tokens and, at every position, "
    "predicts a probability for each token of its vocabulary to come next. The model "
    "described here is a decoder-only transformer: each layer mixes the positions with "
    "causal self-attention, so that a token can only look at the tokens before it, and "
    "then transforms every position on its own with a small feed-forward network. The "
    "attention of a layer is split into heads; each head projects the input into queries, "
    "keys and values, scores every query against the keys of the earlier positions, and "
    "averages the values with the softmax of those scores. Rotary position embeddings "
    "rotate the queries and keys by an angle that grows with the position, which makes "
    "the score of two tokens depend on how far apart they are rather than on where they "
    "stand. Grouped-query attention lets several query heads share one key and value "
    "head, which shrinks the cache a decoder keeps while it writes an answer one token "
    "at a time. Quantization stores the weights in fewer bits: a block of thirty-two "
    "weights shares one scale and one minimum, and every weight becomes a small integer "
    "between them. The quality of the model barely changes, while the file becomes "
    "several times smaller and loads in a fraction of the time."
)

CODE = '''\
def merge_sorted(left: list[int], right: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out: list[int] = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out


class Counter:
    """Count how often each word occurs in a text."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, text: str) -> None:
        for word in text.lower().split():
            word = word.strip(".,;:!?")
            if word:
                self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n: int) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
'''

#: Real text through the chat path: a system turn, prose, code, a follow-up.
CONVERSATION = [
    {"role": "system", "content": "You are a patient teacher of computer science."},
    {"role": "user", "content": "Explain how a language model like you works."},
    {"role": "assistant", "content": PROSE},
    {"role": "user", "content": "Show me some Python you would write."},
    {"role": "assistant", "content": "Here is a merge step and a word counter:\n\n"
                                     "```python\n" + CODE + "```"},
    {"role": "user", "content": "Which of the two functions is faster?"},
]


# --- the models, loaded once per module -------------------------------------------------


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private ``TINYLM_GGUF_CACHE`` for the session (never the user's cache)."""
    folder = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYLM_GGUF_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def converted(smollm2_gguf: Path, gguf_cache: Path) -> Path:
    """The checkpoint folder ``--model x.gguf`` stands for, converted once."""
    folder = resolve_checkpoint_dir(smollm2_gguf)
    assert folder.parent == gguf_cache
    return folder


@pytest.fixture(scope="module")
def ours(converted: Path) -> tuple[Any, Any]:
    """tinylm's model and tokenizer, loaded as ``tinylm chat --model x.gguf`` loads them."""
    return load_model(converted), require_tokenizer_of(converted, "the test needs it")


@pytest.fixture(scope="module")
def hf(smollm2_gguf: Path) -> tuple[Any, Any]:
    transformers = pytest.importorskip("transformers")
    where, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)


@pytest.fixture(scope="module")
def llama(smollm2_gguf: Path) -> Iterator[Any]:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(model_path=str(smollm2_gguf), logits_all=True, n_ctx=1024,
                            verbose=False, n_threads=2)
    yield model
    model.close()


@pytest.fixture(scope="module")
def real_ids(ours: tuple[Any, Any]) -> list[int]:
    ids = render_chat(ours[1], CONVERSATION)
    assert len(ids) >= 512
    return ids


@pytest.fixture(scope="module")
def our_logits(ours: tuple[Any, Any], real_ids: list[int]) -> torch.Tensor:
    return _logits(ours[0], real_ids)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return getattr(out, "logits", out)[0].float()


def _llama_logits(llama: Any, ids: list[int]) -> np.ndarray:
    llama.reset()
    llama.eval(ids)
    return np.array(llama.scores[:len(ids)], dtype=np.float32)


def _chat_answer(ours: tuple[Any, Any], question: str,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[int]]:
    """``tinylm chat --temperature 0 --prompt QUESTION``'s answer through ChatSession (the
    CLI's code path): its text, and the tokens it generated (the stop token included)."""
    tokens: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
        for nxt in _GENERATE_STREAM(*args, **kwargs):
            tokens.append(int(nxt[0]))
            yield nxt

    monkeypatch.setattr(chatsession, "generate_stream", spy)
    session = chatsession.ChatSession(*ours, temperature=0, max_new_tokens=ANSWER_TOKENS)
    return "".join(session.reply(question)), tokens


# --- 1. transformers: the exact oracle ---------------------------------------------------


def test_logits_on_real_text_equal_transformers(hf, real_ids, our_logits) -> None:
    theirs = _logits(hf[0], real_ids)
    assert theirs.shape == our_logits.shape == (len(real_ids), 49152)
    assert (theirs - our_logits).abs().max() < 1e-4


def test_greedy_chat_answers_equal_transformers(ours, hf, monkeypatch) -> None:
    model, tokenizer = hf
    stops = stop_ids(ours[1])
    assert stops == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    answers = {}
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        assert render_chat(ours[1], messages) == list(prompt), question
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=ANSWER_TOKENS,
                                 do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        expected = out[0, len(prompt):].tolist()
        text, tokens = _chat_answer(ours, question, monkeypatch)
        assert tokens == expected, question
        assert text == ours[1].decode([t for t in tokens if t not in stops]), question
        answers[question] = text
    assert answers[FRANCE] == "The capital of France is Paris."
    assert answers[QUESTIONS[1]] == "The capital of Japan is Tokyo."
    assert "def " in answers[QUESTIONS[2]] and "**" in answers[QUESTIONS[2]]
    assert "[::-1]" in answers[QUESTIONS[3]] or "reverse" in answers[QUESTIONS[3]]


def test_cli_chat_answers_paris(smollm2_gguf, converted, gguf_cache) -> None:
    env = {**os.environ, "TINYLM_GGUF_CACHE": str(gguf_cache),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    run = subprocess.run([sys.executable, "-m", "tinylm", "chat", "--model", str(smollm2_gguf),
                          "--temperature", "0", "--max-new-tokens", "20", "--prompt", FRANCE],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "The capital of France is Paris."
    assert "converting" not in run.stderr  # the session's conversion was reused


def test_gguf_file_and_converted_folder_give_identical_logits(smollm2_gguf, converted,
                                                              ours, real_ids,
                                                              our_logits) -> None:
    direct, tokenizer, _ = load_gguf(smollm2_gguf)
    assert tokenizer.encode(PROSE + CODE) == ours[1].encode(PROSE + CODE)
    assert render_chat(tokenizer, CONVERSATION) == real_ids
    assert torch.equal(_logits(direct.eval(), real_ids), our_logits)


# --- 2. llama.cpp: close, not equal (8-bit activations) ----------------------------------


def test_teacher_forced_agreement_with_llama_cpp(llama, real_ids, our_logits) -> None:
    """624 positions: top-1 0.970 (605), max |error| 1.46, mean 0.17 (measured; asserted
    with margin). Not exact: llama.cpp quantizes the activations to 8 bits per block before
    multiplying them by the Q4_1 weights."""
    theirs = _llama_logits(llama, real_ids)
    ours = our_logits.numpy()
    assert theirs.shape == ours.shape and len(real_ids) >= 512
    top1 = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
    error = np.abs(theirs - ours)
    assert top1 >= 0.95, top1
    assert error.max() < 2.5 and error.mean() < 0.25, (error.max(), error.mean())
    assert error.max() > 1e-2  # not the exact oracle: a different arithmetic
    # they disagree only where tinylm's top two are near-tied (measured: gap <= 0.16)
    top2 = np.sort(ours, axis=-1)[:, -2:]
    gaps = (top2[:, 1] - top2[:, 0])[theirs.argmax(-1) != ours.argmax(-1)]
    assert gaps.max() < 0.3, gaps.max()


# --- 3. "What is the capital of France?" through llama.cpp -------------------------------


def test_france_differs_in_llama_cpp_by_arithmetic_not_prompt(llama, ours, hf) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    messages = [{"role": "user", "content": FRANCE}]
    ids = render_chat(ours[1], messages)
    assert ids == list(hf[1].apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])
    # the prompt: llama.cpp's own chat handler renders and tokenizes the same ids
    formatter = Jinja2ChatFormatter(template=llama.metadata["tokenizer.chat_template"],
                                    eos_token="<|im_end|>", bos_token="<|im_start|>",
                                    add_generation_prompt=True)
    prompt = formatter(messages=messages).prompt
    assert llama.tokenize(prompt.encode(), add_bos=True, special=True) == ids
    greedy = llama.create_chat_completion(messages=messages, max_tokens=12, temperature=0)
    assert greedy["usage"]["prompt_tokens"] == len(ids) == 37
    assert greedy["choices"][0]["message"]["content"].startswith("L'Étoile, la Cité")
    # the arithmetic: greedy on the same ids, llama.cpp's logits against tinylm's
    first = _logits(ours[0], ids)[-1]
    top2 = torch.topk(first, 2)
    assert top2.indices.tolist() == [504, 60]  # "The", "L"
    assert [ours[1].decode([i]) for i in top2.indices.tolist()] == ["The", "L"]
    gap = float(top2.values[0] - top2.values[1])
    assert 0 < gap < 0.1  # 0.082: a near-tie
    theirs = _llama_logits(llama, ids)[-1]
    assert int(theirs.argmax()) == 60 and 0 < theirs[60] - theirs[504] < 0.1  # 0.089
    answer = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris."
    forced = _llama_logits(llama, ids + answer[:-1])[len(ids) - 1:]
    assert forced[1:].argmax(-1).tolist() == answer[1:]  # after "The", the same answer
    assert forced[0].argmax() == 60  # the only divergence: the first token


def test_france_with_llama_cpp_default_sampling_depends_on_the_seed(llama) -> None:
    """Its defaults (temperature 0.2, top-k 40, top-p 0.95, min-p 0.05) keep both near-tied
    first tokens, so the answer is "Paris" for some seeds and not for others."""
    messages = [{"role": "user", "content": FRANCE}]
    answers = [llama.create_chat_completion(messages=messages, max_tokens=8, seed=seed)
               ["choices"][0]["message"]["content"] for seed in range(6)]
    assert any(a.startswith("The capital of France is Paris") for a in answers), answers
    assert any(a.startswith("L") for a in answers), answers
