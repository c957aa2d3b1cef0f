"""A model's own chat settings, and its chat template rendered as transformers renders it.

:class:`TokenizerSettings` is what a tokenizer carries besides its vocabulary: the chat
template (Jinja2 text), the roles of its special tokens (bos, eos, pad, unk), whether
a prompt starts with bos (``add_bos_token``) and the end-of-turn tokens that stop an
answer. Its fields are Hugging Face ``tokenizer_config.json``'s keys
(:meth:`TokenizerSettings.from_hf` reads that dict, a GGUF's metadata mapped to those
keys, or ``special_tokens_map.json``; :meth:`TokenizerSettings.to_hf` writes it).

:func:`render_template` renders a template exactly as ``apply_chat_template`` of
transformers does: jinja2's ``ImmutableSandboxedEnvironment`` (never anything but the
sandbox) with ``trim_blocks``/``lstrip_blocks``, loop controls and the
``{% generation %}`` block (rendered as its body), the globals
``raise_exception`` and ``strftime_now``, a ``tojson`` filter that does not escape HTML,
and the variables ``messages``, ``add_generation_prompt``, ``tools`` and the named
special tokens (``bos_token``, ``eos_token``, ...). Every template error is one line.

:func:`mark_special` and :func:`split_marked` keep a user's text from ever becoming a
special token: special-token spellings in message contents are wrapped in two
private-use markers before rendering, and the rendered text is cut at them, so the
encoder reads those spellings as ordinary text (transformers'
``sanitize_control_tokens=True`` does the same, with the same pieces).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tinylm.core.display import display_name
from tinylm.core.errors import DataError

log = logging.getLogger(__name__)

#: The named special tokens of Hugging Face's tokenizer config, in its order.
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                 "cls_token", "mask_token")
#: Spellings of end-of-turn tokens (llama.cpp's list of end-of-generation tokens):
#: one is a stop token of a model whose vocabulary has it as a special token and whose
#: chat template writes it.
END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>",
                     "</s>", "<|return|>", "<|call|>")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
_MAX_CONFIG_BYTES = 16 << 20
_MARK_START, _MARK_END = "\uf8f0", "\uf8f1"  # private use: never in a template's own text


def _token_text(key: str, value: Any) -> str | None:
    """A special token as HF stores it: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value or None
    raise DataError(f"tokenizer config's {key} is {value!r}, not a token string; fix the "
                    f"tokenizer_config.json")


def _template_text(value: Any) -> str | None:
    """chat_template as a string: HF also allows a list of {"name", "template"} (the one
    named "default" is used)."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
        named = {t.get("name"): t.get("template") for t in value}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise DataError("tokenizer config's chat_template is neither a string nor a list with a "
                    "template named 'default'; fix the tokenizer_config.json")


def _flag(key: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise DataError(f"tokenizer config's {key} is {value!r}, not true or false")


@dataclass(frozen=True)
class TokenizerSettings:
    """A tokenizer's chat template and special-token roles (all optional)."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    model_max_length: int | None = None
    #: Tokens beyond eos that end an answer (e.g. ``<|im_end|>``); the template's
    #: known end-of-turn tokens are added to these (:func:`end_of_turn_tokens`).
    end_of_turn: tuple[str, ...] = field(default=())

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], chat_template: str | None = None
                ) -> TokenizerSettings:
        """The settings in a ``tokenizer_config.json`` dict (unknown keys ignored);
        ``chat_template`` (a ``chat_template.jinja``'s text) wins over the dict's."""
        if not isinstance(d, Mapping):
            raise DataError(f"a tokenizer config must be a JSON object, got {type(d).__name__}")
        length = d.get("model_max_length")
        if not isinstance(length, int) or isinstance(length, bool) or not 0 < length < 2**40:
            length = None  # HF writes 1e30 for "no limit"
        eot = d.get("end_of_turn_tokens") or ()
        if not isinstance(eot, (list, tuple)) or not all(isinstance(t, str) for t in eot):
            raise DataError("tokenizer config's end_of_turn_tokens must be a list of strings")
        return cls(
            chat_template=chat_template or _template_text(d.get("chat_template")),
            **{k: _token_text(k, d.get(k)) for k in ("bos_token", "eos_token", "pad_token",
                                                      "unk_token")},
            add_bos_token=_flag("add_bos_token", d.get("add_bos_token")),
            add_eos_token=_flag("add_eos_token", d.get("add_eos_token")),
            model_max_length=length, end_of_turn=tuple(dict.fromkeys(eot)),
        )

    def to_hf(self) -> dict[str, Any]:
        """The set fields as ``tokenizer_config.json`` keys (``end_of_turn`` as tinylm's
        ``end_of_turn_tokens``, a key transformers ignores)."""
        out: dict[str, Any] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token",
                    "add_eos_token", "model_max_length", "chat_template"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.end_of_turn:
            out["end_of_turn_tokens"] = list(self.end_of_turn)
        return out

    def merged(self, other: TokenizerSettings) -> TokenizerSettings:
        """These settings with every field that ``other`` sets taken from ``other``."""
        changes = {k: v for k, v in vars(other).items() if v not in (None, ())}
        return replace(self, **changes)

    @property
    def empty(self) -> bool:
        return self == TokenizerSettings()

    def missing_tokens(self, token_to_id: Callable[[str], int | None]) -> list[str]:
        """"role 'token'" for each token named here that ``token_to_id`` does not know."""
        named = [(r, getattr(self, r)) for r in ("bos_token", "eos_token", "pad_token",
                                                 "unk_token")]
        named += [("end-of-turn token", t) for t in self.end_of_turn]
        return [f"{role} {token!r}" for role, token in named
                if token is not None and token_to_id(token) is None]


# --- the files beside a tokenizer.json -------------------------------------------------------


def _read_text(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise DataError(f"{display_name(path)} is over {_MAX_CONFIG_BYTES >> 20} MiB; it "
                            f"is not a tokenizer config")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {display_name(path)}: {_one_line(exc)}; restore or "
                        f"remove it") from exc


def _read_object(path: Path) -> dict[str, Any]:
    text = _read_text(path)
    if text is None:
        return {}
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{display_name(path)} is not valid JSON ({_one_line(exc)}); "
                        f"restore or remove it") from None
    if not isinstance(d, dict):
        raise DataError(f"{display_name(path)} is not a JSON object; restore or remove it")
    return d


def read_settings(folder: str | Path,
                  token_to_id: Callable[[str], int | None] | None = None) -> TokenizerSettings:
    """The settings in a folder's ``tokenizer_config.json``, ``special_tokens_map.json``
    (fills in the token roles the config lacks) and ``chat_template.jinja`` (wins over
    the config's chat_template); empty when it has none of them. With ``token_to_id``
    (the tokenizer's), a bos/eos/pad/unk token it lacks is dropped with a warning (e.g.
    GPT-2's ``<|endoftext|>`` defaults in a smaller vocabulary)."""
    folder = Path(folder)
    config = _read_object(folder / TOKENIZER_CONFIG_FILE)
    special = _read_object(folder / SPECIAL_TOKENS_MAP_FILE)
    d = {**{k: v for k, v in special.items() if k in SPECIAL_ROLES}, **config}
    try:
        settings = TokenizerSettings.from_hf(d, _read_text(folder / CHAT_TEMPLATE_FILE))
    except DataError as exc:
        raise DataError(f"{display_name(folder)}: {exc}") from None
    for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(settings, role)
        if token_to_id is not None and token is not None and token_to_id(token) is None:
            log.warning("note: %s names %s %r, which its tokenizer lacks; ignored", folder,
                        role, token)
            settings = replace(settings, **{role: None})
    return settings


def write_settings(settings: TokenizerSettings, folder: str | Path) -> Path | None:
    """Write ``settings`` as ``folder/tokenizer_config.json`` (nothing when empty)."""
    if settings.empty:
        return None
    path = Path(folder) / TOKENIZER_CONFIG_FILE
    path.write_text(json.dumps(settings.to_hf(), indent=2, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    return path


# --- rendering ------------------------------------------------------------------------------


def _raise_exception(message: Any) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _generation_tag() -> Any:
    """transformers' ``{% generation %}...{% endgeneration %}`` (which marks assistant
    text for its masks) as a plain block: tinylm finds the assistant spans itself."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return Generation


def _plain_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


@lru_cache(maxsize=1)
def _namespace_class() -> Any:
    """jinja2's ``namespace``, refusing names that start with "_" (a template could
    otherwise store an attribute the sandbox would not let it read)."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute cannot start with "
                                                  f"'_' ({name!r})")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


@lru_cache(maxsize=16)
def compile_template(template: str) -> Any:
    """The compiled sandboxed template; a one-line DataError when it does not parse."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise DataError("a model's own chat template needs the 'jinja2' package; install "
                        "it with: pip install 'jinja2>=3.1.6'") from exc
    if _version(jinja2.__version__) < (3, 1, 6):
        raise DataError(f"jinja2 {jinja2.__version__} has known sandbox escapes, and a chat "
                        f"template is a model's code; upgrade: pip install 'jinja2>=3.1.6'")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols,
                                                    _generation_tag()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _plain_dict  # not the type itself: nothing to climb from
    env.globals["namespace"] = _namespace_class()
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise DataError(f"the model's chat template does not parse: {_one_line(exc)} (line "
                        f"{exc.lineno}); fix its chat_template") from None


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text or type(exc).__name__)[:300]


def render_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = False,
                    special_tokens: Mapping[str, str | None] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    **variables: Any) -> str:
    """The text of ``messages`` rendered by ``template`` (see the module docstring);
    ``special_tokens`` maps bos_token, eos_token, ... to their spellings."""
    import jinja2

    compiled = compile_template(template)
    names = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    plain = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    try:
        return compiled.render(messages=plain, tools=None if tools is None else list(tools),
                               documents=None, add_generation_prompt=add_generation_prompt,
                               **{**names, **variables})
    except jinja2.exceptions.SecurityError as exc:
        raise DataError(f"the model's chat template tried something the sandbox forbids: "
                        f"{_one_line(exc)}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise DataError(f"the model's chat template refused the conversation: "
                        f"{_one_line(exc)}") from None
    except Exception as exc:  # a template's own bug: a bad index, a type error
        raise DataError(f"the model's chat template failed: {type(exc).__name__}: "
                        f"{_one_line(exc)}") from None


# --- special-token spellings in user text ----------------------------------------------------


def _pattern(specials: Sequence[str]) -> re.Pattern:
    longest = sorted(set(specials), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest)) or "(?!)")


def mark_special(value: Any, specials: Sequence[str]) -> Any:
    """``value`` (a string, or lists/dicts of them) with every special-token spelling
    wrapped in the markers (markers already there are dropped first)."""
    return _mark(value, _pattern(specials))


def _mark(value: Any, pattern: re.Pattern) -> Any:
    if isinstance(value, str):
        value = value.replace(_MARK_START, "").replace(_MARK_END, "")
        return pattern.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, value)
    if isinstance(value, Mapping):
        return {k: _mark(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(v, pattern) for v in value]
    return value


def split_marked(text: str, specials: Sequence[str]) -> list[str]:
    """Rendered ``text`` cut at the markers: [text, marked, text, marked, ..., text]; the
    marked pieces (odd places) are user text, a lone marker leaves an empty one."""
    inner = _pattern(specials).pattern
    markers = re.compile(f"{_MARK_START}({inner}){_MARK_END}|[{_MARK_START}{_MARK_END}]")
    return [p or "" for p in markers.split(text)]


def end_of_turn_tokens(settings: TokenizerSettings, specials: Sequence[str]) -> list[str]:
    """The tokens that end an answer: eos, the settings' ``end_of_turn``, and each known
    end-of-turn spelling (:data:`END_OF_TURN_NAMES`) that is a special token and that
    the chat template writes."""
    found = [t for t in (settings.eos_token, *settings.end_of_turn) if t]
    template = settings.chat_template or ""
    found += [t for t in END_OF_TURN_NAMES if t in specials and t in template]
    return list(dict.fromkeys(found))


__all__ = [
    "CHAT_TEMPLATE_FILE",
    "END_OF_TURN_NAMES",
    "SPECIAL_TOKENS_MAP_FILE",
    "TOKENIZER_CONFIG_FILE",
    "SPECIAL_ROLES",
    "TokenizerSettings",
    "compile_template",
    "end_of_turn_tokens",
    "mark_special",
    "read_settings",
    "render_template",
    "split_marked",
    "write_settings",
]
