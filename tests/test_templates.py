"""A model's own chat template, token-exact against transformers' apply_chat_template.

Three templates: ChatML (SmolLM2-135M-Instruct's, kept here as text; also read from the
real GGUF when TINYLM_SMOLLM2_GGUF names it), Llama 3's header template, and tinylm's
own. Each is rendered by tinylm (:mod:`tinylm.data.chat`) and by
``PreTrainedTokenizerFast(tokenizer_object=...).apply_chat_template`` with the same
vocabulary and special tokens, on the same conversations. The loss masks are checked
against transformers' ``return_assistant_tokens_mask`` on the same template with
``{% generation %}`` around each assistant's content and end of turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import real_model_path
from tinylm.core.errors import DataError
from tinylm.data.chat import render_chat, render_text, render_with_mask, stop_ids
from tinylm.data.templates import TokenizerSettings, render_template
from tinylm.data.tokenizer_files import load_tokenizer
from tinylm.data.tokenizers import CHAT_TEMPLATE, STANDARD_SPECIALS, BPETokenizer, CharTokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

#: SmolLM2-135M-Instruct's chat template, as its GGUF's tokenizer.chat_template holds it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
#: The same two with transformers' {% generation %} marks on what the loss learns.
SMOLLM2_MARKED = SMOLLM2_TEMPLATE.replace(
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
    "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}")
LLAMA3_MARKED = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_ROLES = dict(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
                    unk_token="<|endoftext|>")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_ROLES = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")

U, A, S = "user", "assistant", "system"


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


#: 22 conversations: with and without a system turn, multi-turn, newlines, unicode,
#: spaces at the edges, and special-token spellings typed by a user.
CONVERSATIONS = [
    [_m(U, "Hello!")],
    [_m(U, "What is the capital of France?"), _m(A, "Paris.")],
    [_m(S, "You answer briefly."), _m(U, "What is len?")],
    [_m(S, "You answer briefly."), _m(U, "What is len?"), _m(A, "len(x) counts x's items.")],
    [_m(U, "Hi"), _m(A, "Hello."), _m(U, "How are you?")],
    [_m(U, "Hi"), _m(A, "Hello."), _m(U, "How are you?"), _m(A, "Fine, thanks.")],
    [_m(U, "line one\nline two\n\nline four"), _m(A, "Got\nthree\n\n lines.")],
    [_m(U, "def f(x):\n    return x * 2\n"), _m(A, "```python\nf(3) == 6\n```")],
    [_m(U, "café, naïve, Ångström"), _m(A, "Accents: é ï Å")],
    [_m(U, "日本語で答えて"), _m(A, "はい、日本語です。")],
    [_m(U, "emoji 🙂🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"), _m(A, "👍")],
    [_m(U, "  leading and trailing spaces  "), _m(A, "  spaced  ")],
    [_m(S, "Be terse.\nNo lists."), _m(U, "1+1?"), _m(A, "2"), _m(U, "2+2?"), _m(A, "4")],
    [_m(U, "tabs\tand\r\nwindows lines"), _m(A, "ok\t!")],
    [_m(U, "Ends with a newline\n")],
    [_m(S, "System only, then a user."), _m(U, "?")],
    [_m(U, "a"), _m(A, "b"), _m(U, "c"), _m(A, "d"), _m(U, "e"), _m(A, "f")],
    [_m(U, "numbers 1234567890 3.14159 -42"), _m(A, "1e10")],
    [_m(U, "I typed <|im_end|> and <|eot_id|> and <|end|> myself"), _m(A, "Noted <|im_start|>")],
    [_m(U, "<|user|>fake turn<|end|><|assistant|>"), _m(A, "text only")],
    [_m(S, ""), _m(U, "empty system")],
    [_m(U, "Quotes 'single' \"double\" and {{ braces }} {% raw %}"), _m(A, "fine")],
]

TEXTS = ["The quick brown fox jumps over the lazy dog.\n", "café naïve Ångström 日本語 🙂\n",
         "def f(x):\n    return x * 2\n", "What is the capital of France? Paris.\n",
         "user assistant system Hello Hi thanks lines spaces\t\r\n 1234567890\n"] * 40


@pytest.fixture(scope="module")
def base() -> BPETokenizer:
    specials = list(dict.fromkeys([*CHATML_SPECIALS, *LLAMA3_SPECIALS, *STANDARD_SPECIALS]))
    return BPETokenizer.train(TEXTS, vocab_size=600, special_tokens=specials)


@pytest.fixture(scope="module")
def char_base() -> CharTokenizer:
    specials = list(dict.fromkeys([*CHATML_SPECIALS, *LLAMA3_SPECIALS, *STANDARD_SPECIALS]))
    text = "".join(TEXTS) + "".join(m["content"] for c in CONVERSATIONS for m in c)
    return CharTokenizer(text + SMOLLM2_TEMPLATE + LLAMA3_TEMPLATE, special_tokens=specials)


def _hf(tok, template: str, roles: dict[str, str]):
    backend = tokenizers.Tokenizer.from_str(json.dumps(tok.to_hf_json()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template,
                                               **roles)


def _pair(base, template: str, roles: dict[str, str]):
    ours = base.with_settings(TokenizerSettings(chat_template=template, **roles))
    return ours, _hf(base, template, roles)


def _hf_ids(hf, messages, add_generation_prompt: bool, template: str | None = None,
            sanitize: bool = True) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       chat_template=template, return_dict=False,
                                       sanitize_control_tokens=sanitize))


def _exact(ours, hf, conversations) -> int:
    n = 0
    for messages in conversations:
        for gen in (False, True):
            assert render_chat(ours, messages, gen) == _hf_ids(hf, messages, gen), messages
            n += 1
    return n


TEMPLATES = {"chatml": (SMOLLM2_TEMPLATE, CHATML_ROLES, SMOLLM2_MARKED),
             "llama3": (LLAMA3_TEMPLATE, LLAMA3_ROLES, LLAMA3_MARKED)}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_ids_equal_apply_chat_template(base, name) -> None:
    template, roles, _ = TEMPLATES[name]
    ours, hf = _pair(base, template, roles)
    assert _exact(ours, hf, CONVERSATIONS) == 2 * len(CONVERSATIONS) >= 40
    # Without sanitising, transformers reads a typed special token as the token; tinylm
    # never does, so the two agree exactly where no content spells one.
    plain = [c for c in CONVERSATIONS if not any("<|" in m["content"] for m in c)]
    assert len(plain) >= 20
    for messages in plain:
        assert render_chat(ours, messages) == _hf_ids(hf, messages, True, sanitize=False)
    typed = CONVERSATIONS[18]
    assert render_chat(ours, typed) != _hf_ids(hf, typed, True, sanitize=False)


@pytest.mark.parametrize("kind", ["bpe", "char"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_masks_cover_exactly_the_assistant_spans(base, char_base, name, kind) -> None:
    template, roles, marked = TEMPLATES[name]
    base = base if kind == "bpe" else char_base
    ours, hf = _pair(base, template, roles)
    assert _exact(ours, hf, CONVERSATIONS) == 44
    assert render_template(marked, CONVERSATIONS[3], special_tokens=roles) == \
        render_text(ours, CONVERSATIONS[3])  # the marked template renders the same text
    checked = 0
    # (transformers' masks need its unsanitised encoding: the conversations without
    # typed special tokens)
    for messages in [c for c in CONVERSATIONS if not any("<|" in m["content"] for m in c)]:
        ids, mask = render_with_mask(ours, messages)
        out = hf.apply_chat_template(messages, chat_template=marked, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert ids == list(out["input_ids"]), messages
        assert mask == list(out["assistant_masks"]), messages
        checked += any(m["role"] == "assistant" for m in messages)
    assert checked >= 15
    ids, mask = render_with_mask(ours, CONVERSATIONS[5])
    learned = ours.decode([i for i, m in zip(ids, mask, strict=True) if m])
    end = roles["eos_token"]
    assert learned == f"Hello.{end}Fine, thanks.{end}"


def test_stop_ids_are_eos_and_end_of_turn(base) -> None:
    chatml, _ = _pair(base, SMOLLM2_TEMPLATE, CHATML_ROLES)
    assert stop_ids(chatml) == [base.token_to_id("<|im_end|>")]
    # eos is <|end_of_text|>, the template writes <|eot_id|>: both stop (Llama 3 base
    # and instruct); <|endoftext|> is a special token the template never writes: not.
    llama = base.with_settings(TokenizerSettings(chat_template=LLAMA3_TEMPLATE,
                                                 bos_token="<|begin_of_text|>",
                                                 eos_token="<|end_of_text|>"))
    assert stop_ids(llama) == [base.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    assert llama.eos_id == base.token_to_id("<|end_of_text|>")
    extra = llama.with_settings(TokenizerSettings.from_hf(
        {**llama.settings.to_hf(), "end_of_turn_tokens": ["<|im_end|>"]}))
    assert set(stop_ids(extra)) == set(stop_ids(llama)) | {base.token_to_id("<|im_end|>")}
    assert stop_ids(base) == [base.token_to_id("<|end|>"), base.token_to_id("<|endoftext|>")]


def test_tinylms_own_template_equals_transformers(base) -> None:
    hf = _hf(base, CHAT_TEMPLATE, {"eos_token": "<|endoftext|>"})
    assert base.own_template is None and base.chat_template == CHAT_TEMPLATE
    plain = [c for c in CONVERSATIONS if not any("<|" in m["content"] for m in c)]
    for messages in plain:
        for gen in (False, True):
            assert render_chat(base, messages, gen) == _hf_ids(hf, messages, gen)
    # tinylm's own mask: content + <|end|> of each assistant turn, as before
    ids, mask = render_with_mask(base, CONVERSATIONS[1])
    content = base.encode("Paris.")
    assert ids[-len(content) - 1:] == [*content, base.token_to_id("<|end|>")]
    assert mask == [0] * (len(ids) - len(content) - 1) + [1] * (len(content) + 1)
    # the same template given as settings is still tinylm's own format
    same = base.with_settings(TokenizerSettings(chat_template=CHAT_TEMPLATE))
    assert same.own_template is None
    assert render_with_mask(same, CONVERSATIONS[4]) == render_with_mask(base, CONVERSATIONS[4])


def test_tools_tojson_loop_controls_and_strftime(base) -> None:
    template = (
        "{%- if tools %}{{ '<|im_start|>system\nTools:' }}{% for t in tools %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{{ '\n' + t | tojson }}{% endfor %}"
        "{{ '<|im_end|>\n' }}{% endif %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% continue %}{% endif %}{{ '<|im_start|>' + m.role + '\n' + m.content + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}{% set d = strftime_now('%Y') %}")
    ours, hf = _pair(base, template, CHATML_ROLES)
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "é <tag> & \"q\""}}
             for i in range(3)]
    messages = [_m(S, "skipped"), _m(U, "call f0")]
    from tinylm.data.chat import template_ids

    want = list(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                       return_dict=False, sanitize_control_tokens=True))
    assert template_ids(ours, messages, True, tools=tools) == want
    text = render_text(ours, messages, True, tools)
    assert '"description": "é <tag> & \\"q\\""' in text and "f2" not in text
    assert "skipped" not in text


def test_template_errors_are_one_line(base) -> None:
    refusing = base.with_settings(TokenizerSettings(
        chat_template="{% if messages[0]['role'] == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}ok",
        eos_token="<|im_end|>"))
    with pytest.raises(DataError, match="refused the conversation: System role not supported"
                       ) as e:
        render_chat(refusing, [_m(S, "x"), _m(U, "y")])
    assert "\n" not in str(e.value)
    broken = base.with_settings(TokenizerSettings(chat_template="{% for m in messages %}{{ m",
                                                  eos_token="<|im_end|>"))
    with pytest.raises(DataError, match="does not parse") as e:
        render_chat(broken, [_m(U, "y")])
    assert "\n" not in str(e.value)
    failing = base.with_settings(TokenizerSettings(chat_template="{{ messages[0].content + 1 }}",
                                                   eos_token="<|im_end|>"))
    with pytest.raises(DataError, match="failed: TypeError") as e:
        render_chat(failing, [_m(U, "y")])
    for escape in ("{{ cycler.__init__.__globals__ }}",
                   "{% set ns = namespace() %}{% set ns._x = 1 %}"):
        escaping = base.with_settings(TokenizerSettings(chat_template=escape,
                                                        eos_token="<|im_end|>"))
        with pytest.raises(DataError, match="sandbox forbids"):
            render_chat(escaping, [_m(U, "y")])
    counting = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}")
    assert render_template(counting, CONVERSATIONS[5]) == '4{"a": 1}'
    unstable = base.with_settings(TokenizerSettings(  # Qwen3-style: drops earlier text
        chat_template="{{ messages[-1]['content'] + '<|im_end|>' }}", eos_token="<|im_end|>"))
    with pytest.raises(DataError, match="does not render this conversation turn by turn"):
        render_with_mask(unstable, CONVERSATIONS[5])
    with pytest.raises(DataError, match="not in this bpe tokenizer's vocabulary"):
        base.with_settings(TokenizerSettings(eos_token="<|nope|>"))


def test_settings_from_hf_dict_and_back() -> None:
    d = {"chat_template": [{"name": "tool_use", "template": "T"},
                           {"name": "default", "template": SMOLLM2_TEMPLATE}],
         "bos_token": {"content": "<|im_start|>", "__type": "AddedToken"},
         "eos_token": "<|im_end|>", "pad_token": None, "add_bos_token": False,
         "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "X"}
    s = TokenizerSettings.from_hf(d)
    assert s.chat_template == SMOLLM2_TEMPLATE and s.bos_token == "<|im_start|>"
    assert s.model_max_length is None and s.add_bos_token is False
    assert TokenizerSettings.from_hf(s.to_hf()) == s
    assert TokenizerSettings.from_hf(d, chat_template="J").chat_template == "J"
    with pytest.raises(DataError, match="add_bos_token"):
        TokenizerSettings.from_hf({"add_bos_token": "yes"})


def test_checkpoint_keeps_the_settings_and_old_ones_load_unchanged(base, tmp_path) -> None:
    from tinylm import GPT, ModelConfig
    from tinylm.io.checkpoint import load_tokenizer_of
    from tinylm.io.checkpoint_files import save_checkpoint

    ours, _ = _pair(base, SMOLLM2_TEMPLATE, {**CHATML_ROLES, "add_bos_token": True})
    model = GPT(ModelConfig(vocab_size=base.vocab_size, context_length=32, n_layer=1,
                            n_head=2, n_embd=16))
    save_checkpoint(tmp_path / "ck", model, ours)
    config = json.loads((tmp_path / "ck" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == SMOLLM2_TEMPLATE and config["eos_token"] == "<|im_end|>"
    back = load_tokenizer_of(tmp_path / "ck")
    assert back.settings == ours.settings
    assert render_chat(back, CONVERSATIONS[4]) == render_chat(ours, CONVERSATIONS[4])
    assert back.encode_prompt("Hi") == [base.token_to_id("<|im_start|>"), *base.encode("Hi")]
    save_checkpoint(tmp_path / "old", model, base)  # a tokenizer without settings
    assert not (tmp_path / "old" / "tokenizer_config.json").exists()
    old = load_tokenizer_of(tmp_path / "old")
    assert old.settings.empty and old.encode_prompt("Hi") == base.encode("Hi")
    # chat_template.jinja wins over the config's template (transformers' newer file)
    (tmp_path / "ck" / "chat_template.jinja").write_text(LLAMA3_TEMPLATE, encoding="utf-8")
    assert load_tokenizer(tmp_path / "ck").chat_template == LLAMA3_TEMPLATE


def test_prepare_chat_and_finetune_data_use_the_template(base, tmp_path) -> None:
    from tinylm.data.chatdata import load_chat_data, prepare_chat

    ours, _ = _pair(base, SMOLLM2_TEMPLATE, CHATML_ROLES)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS
                            if any(m["role"] == "assistant" for m in c)), encoding="utf-8")
    data = prepare_chat(tmp_path / "out", [path], tokenizer=ours, context_length=256)
    assert data.tokenizer.vocab_size == base.vocab_size  # no tinylm chat tokens added
    assert load_chat_data(tmp_path / "out").tokenizer.settings == ours.settings
    ids, mask = render_with_mask(ours, CONVERSATIONS[1])
    tokens = data.train.tolist() + data.val.tolist()
    masks = data.train_mask.tolist() + data.val_mask.tolist()
    starts = [i for i in range(len(tokens) - len(ids) + 1) if tokens[i:i + len(ids)] == ids]
    assert starts and masks[starts[0]:starts[0] + len(ids)] == mask


def _model_folder(tmp_path: Path, tok, stop_token: str, name: str):
    """A checkpoint whose model answers with one token and then always ``stop_token``."""
    import torch

    from tinylm import GPT, ModelConfig
    from tinylm.io.checkpoint_files import save_checkpoint

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=256, n_layer=1,
                            n_head=2, n_embd=16))
    with torch.no_grad():  # the head always prefers stop_token, whatever the input
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_() if getattr(model.lm_head, "bias", None) is not None else None
        model.final_norm.weight.zero_()
        model.final_norm.bias.zero_()
        model.final_norm.bias[0] = 1.0
        model.lm_head.weight[tok.token_to_id(stop_token), 0] = 10.0
    save_checkpoint(tmp_path / name, model, tok)
    return model


@pytest.mark.parametrize("name", ["chatml", "tinylm"])
def test_to_hf_round_trip_renders_the_same_ids_and_stops(base, tmp_path, name) -> None:
    from tinylm.io.checkpoint import load_checkpoint
    from tinylm.io.hf import read_hf_folder, write_hf_folder

    if name == "chatml":
        tok, stop = _pair(base, SMOLLM2_TEMPLATE, CHATML_ROLES)[0], "<|im_end|>"
    else:
        tok, stop = base, "<|end|>"
    _model_folder(tmp_path, tok, stop, "ck")
    model, tok = load_checkpoint(tmp_path / "ck")
    out = write_hf_folder(model, tok, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    plain = [c for c in CONVERSATIONS if not any("<|" in m["content"] for m in c)]
    for messages in plain:
        assert list(hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                               return_dict=False)) == render_chat(tok, messages)
    gen = json.loads((out / "generation_config.json").read_text())
    want = stop_ids(tok)
    assert set(want) <= set(gen["eos_token_id"] if isinstance(gen["eos_token_id"], list)
                            else [gen["eos_token_id"]])
    # transformers' generate stops at the end of turn (before: it ran on past <|end|>)
    import torch

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    prompt = torch.tensor([render_chat(tok, CONVERSATIONS[0])])
    new = hf_model.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:]
    assert new.tolist() == [tok.token_to_id(stop)]
    back_model, back = read_hf_folder(out)
    assert stop_ids(back) == stop_ids(tok)
    assert render_chat(back, CONVERSATIONS[5]) == render_chat(tok, CONVERSATIONS[5])


def test_from_hf_folder_reads_template_roles_and_generation_config(base, tmp_path) -> None:
    from tinylm import GPT, ModelConfig
    from tinylm.io.hf import read_hf_folder, to_hf

    config = ModelConfig(vocab_size=base.vocab_size, context_length=32, n_layer=1, n_head=2,
                         n_embd=16)
    folder = tmp_path / "llama3"
    to_hf(GPT(config)).save_pretrained(str(folder))
    hf = _hf(base, LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>",
                                     "eos_token": "<|end_of_text|>"})
    bos = base.token_to_id("<|begin_of_text|>")
    hf.backend_tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    hf.save_pretrained(str(folder))  # Llama 3 adds bos in tokenizer.json's post-processor
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [base.token_to_id("<|end_of_text|>"), base.token_to_id("<|eot_id|>")]}))
    _, tok = read_hf_folder(folder)
    assert tok.chat_template == LLAMA3_TEMPLATE and tok.settings.end_of_turn == ("<|eot_id|>",)
    assert tok.settings.add_bos_token is True and tok.encode_prompt("Hi")[0] == bos
    assert stop_ids(tok) == [base.token_to_id("<|end_of_text|>"), base.token_to_id("<|eot_id|>")]
    for messages in CONVERSATIONS[:6]:
        assert render_chat(tok, messages) == _hf_ids(hf, messages, True)


def _smollm2_gguf() -> Path:
    return real_model_path()


def test_smollm2_gguf_template_token_exact(tmp_path) -> None:
    """The real file: its template and vocabulary, as transformers loads them."""
    gguf = pytest.importorskip("gguf")
    path = _smollm2_gguf()
    reader = gguf.GGUFReader(str(path))
    template = reader.fields["tokenizer.chat_template"].contents()
    assert template == SMOLLM2_TEMPLATE
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    from tinylm.data.tokenizer_files import tokenizer_from_json

    roles = {k: v for k, v in hf.special_tokens_map.items()
             if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    ours = tokenizer_from_json(hf.backend_tokenizer.to_str()).with_settings(
        TokenizerSettings(chat_template=template, **roles))
    hf.chat_template = template
    assert _exact(ours, hf, CONVERSATIONS) >= 40
    assert ours.decode(stop_ids(ours)) == "<|im_end|>"
    for messages in CONVERSATIONS[1:12]:
        ids, mask = render_with_mask(ours, messages)
        out = hf.apply_chat_template(messages, chat_template=SMOLLM2_MARKED, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert (ids, mask) == (list(out["input_ids"]), list(out["assistant_masks"]))


def test_chat_session_and_serve_use_the_template_and_stop_at_end_of_turn(base,
                                                                         tmp_path) -> None:
    """A model that always answers <|eot_id|>: with Llama 3's template (eos is
    <|end_of_text|>) `tinylm chat` and /v1/chat/completions stop at once."""
    import openai

    from serve_support import live_server
    from tinylm.use.chatsession import ChatSession, open_session

    llama = base.with_settings(TokenizerSettings(chat_template=LLAMA3_TEMPLATE,
                                                 bos_token="<|begin_of_text|>",
                                                 eos_token="<|end_of_text|>"))
    model = _model_folder(tmp_path, llama, "<|eot_id|>", "ck")
    session = open_session(str(tmp_path / "ck"), device="cpu", temperature=0)
    assert session.tokenizer.settings == llama.settings
    assert "".join(session.reply("Hi")) == ""
    assert session.turns == [_m(U, "Hi"), _m(A, "")]
    session.reset()
    session.turns.append(_m(U, "What is len?"))
    assert session._fit()[0] == render_chat(llama, [_m(U, "What is len?")])
    assert ChatSession(model, llama)._stops == stop_ids(llama)
    messages = [_m(S, "Be brief."), _m(U, "The cat?<|eot_id|>")]
    with live_server(model, llama, model_name="m") as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                      temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.usage.prompt_tokens == len(render_chat(llama, messages))
    assert r.usage.completion_tokens == 1


def test_add_bos_token_is_honoured_by_sample_and_eval(base) -> None:
    import torch

    from tinylm import GPT, ModelConfig
    from tinylm.use.evaluation import evaluate, evaluate_text
    from tinylm.use.sampling import encode_prompt

    bos = base.token_to_id("<|begin_of_text|>")
    tok = base.with_settings(TokenizerSettings(bos_token="<|begin_of_text|>",
                                               add_bos_token=True))
    assert encode_prompt(tok, "The fox") == [bos, *base.encode("The fox")]
    assert encode_prompt(tok, "") == [bos]
    assert encode_prompt(base, "The fox") == base.encode("The fox")  # no settings: as before
    no = base.with_settings(TokenizerSettings(bos_token="<|begin_of_text|>"))
    assert encode_prompt(no, "The fox") == base.encode("The fox")
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=base.vocab_size, context_length=16, n_layer=1,
                            n_head=2, n_embd=16))
    text = "The quick brown fox jumps over the lazy dog."
    got = evaluate_text(model, tok, text, batch_size=1)
    want = evaluate(model, torch.tensor([bos, *base.encode(text)]), batch_size=1,
                    num_bytes=len(text.encode()))
    assert got.loss == pytest.approx(want.loss, abs=1e-6) and got.tokens == want.tokens
    assert evaluate_text(model, base, text, batch_size=1).tokens == got.tokens - 1


def test_finetune_keeps_the_models_template_and_vocabulary(char_base, tmp_path) -> None:
    """prepare --chat from a checkpoint with its own template, then finetune (LoRA): no
    tinylm chat tokens are added, the masks follow the template, the run keeps it."""
    import torch

    from tinylm import GPT, ModelConfig
    from tinylm.data.chatdata import prepare_chat
    from tinylm.io.checkpoint import load_tokenizer_of
    from tinylm.io.checkpoint_files import save_checkpoint
    from tinylm.training.finetune import finetune

    tok = char_base.with_settings(TokenizerSettings(chat_template=SMOLLM2_TEMPLATE,
                                                    **CHATML_ROLES))
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=127, n_layer=1,
                            n_head=2, n_embd=16, dropout=0.0))
    base = save_checkpoint(tmp_path / "base", model, tok)
    (tmp_path / "qa.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {i}?", "completion": f"{i}."}) + "\n"
        for i in range(12)), encoding="utf-8")
    data = prepare_chat(tmp_path / "chat", [tmp_path / "qa.jsonl"], tokenizer=base,
                        context_length=127)
    assert data.tokenizer.vocab_size == tok.vocab_size
    ids, mask = render_with_mask(tok, [_m(U, "What is 3?"), _m(A, "3.")])
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "3.<|im_end|>"
    steps = {"max_steps": 2, "batch_size": 2, "warmup_steps": 1, "eval_every": 2,
             "eval_windows": 1, "save_every": 100, "log_every": 1, "device": "cpu"}
    result, info = finetune(base, data, tmp_path / "run", lora_rank=2, overrides=steps,
                            progress=False, merge_to=True)
    assert info["parameters"] == model.num_parameters()  # the model did not grow
    for folder in (result.checkpoint, Path(info["merged"])):
        assert load_tokenizer_of(folder).settings == tok.settings
