"""Chat and instruction data: JSONL records turned into tokens and per-token loss masks.

A ``.jsonl`` corpus' kind is decided by its first record: one holding the text field (``text``
or ``--text-field``) is text; else one holding ``messages`` is a conversation; else one holding
``prompt`` and ``completion`` is an instruction example; anything else is refused. Every later
record must be of the first one's kind (a mixed file is refused at the first record of another
kind, by its line number).

- ``messages``: a list of ``{"role", "content"}``, roles system, user, assistant and tool. It is
  rendered with the tokenizer's own chat template (``chat_template.jinja``, else
  ``tokenizer_config.json``'s ``chat_template``), and the text is tokenized whole. Trained are
  the assistant turns: with ``{% generation %}`` tags in the template, what the tags enclose;
  without, what rendering the turn adds to the conversation before it rendered with the
  generation prompt (the turn's text, its end-of-turn token and what the template puts after
  it before the next turn). A boundary between trained and untrained text is checked to fall
  between tokens: the text before it, tokenized alone, gives the first tokens of the whole.
- ``prompt``/``completion``: the prompt's tokens, then the completion's, then the end-of-document
  token, each part tokenized alone (as ``generate`` tokenizes a prompt); the completion and the
  end-of-document token are trained. No template is used.

No end-of-document token is added after a conversation: the template's own tokens end its turns.
Torch-free: jinja2 (for templates) and numpy."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..errors import MeshrunError, bad_value, first_line

ChatKind = Literal["messages", "prompt-completion"]
KINDS: tuple[ChatKind, ...] = ("messages", "prompt-completion")
ROLES = ("system", "user", "assistant", "tool")
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
EXAMPLE_WORDS = {"messages": ("conversation", "conversations"),
                 "prompt-completion": ("example", "examples")}
FORMAT_HINT = ('each line {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}, '
               'or {"prompt": ..., "completion": ...}')


def record_kind(record: object, text_field: str) -> str | None:
    """``text``, ``messages``, ``prompt-completion`` (the module's rule), or None for neither."""
    if not isinstance(record, dict):
        return None
    if text_field in record:
        return "text"
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    return None


PEEK_BYTES = 1 << 20  # of a .jsonl file read to find its first record's kind


def detect(path: str, text_field: str) -> ChatKind | None:
    """The chat kind of a ``.jsonl`` file by its first record, None for text (or a first line
    that does not parse: the text reader names it)."""
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.readline(PEEK_BYTES)
                if not raw:
                    return None
                if raw.strip():
                    break
    except OSError:
        return None  # (the reader names it)
    try:
        kind = record_kind(json.loads(raw), text_field)
    except (ValueError, RecursionError):
        return None
    return "messages" if kind == "messages" else "prompt-completion" if kind == "prompt-completion" else None


def _content_ok(message: dict[str, Any]) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return True
    return content is None and bool(message.get("tool_calls"))  # a call to a tool may come without text


def check_record(record: object, kind: ChatKind, where: str, text_field: str) -> dict[str, Any]:
    """``record`` as a ``kind`` record, checked; a one-line error naming ``where`` (file:line)."""
    got = record_kind(record, text_field)
    if got != kind or not isinstance(record, dict):
        what = {"text": f"a text record ({text_field!r} field)", "messages": "a conversation ('messages')",
                "prompt-completion": "an instruction example ('prompt' and 'completion')"}
        if got is None:
            keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
            raise MeshrunError(f"{where}: neither a conversation nor an instruction example (it has "
                               f"{keys or 'nothing'}) (hint: {FORMAT_HINT})")
        raise MeshrunError(f"{where}: {what[got]} in a file of {EXAMPLE_WORDS[kind][1]} (its first record's kind) "
                           "(hint: one kind of record per corpus; put the others in a corpus of their own)")
    if kind == "prompt-completion":
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                raise MeshrunError(f"{where}: its {key!r} is {type(record[key]).__name__}, not text "
                                   f"(hint: {FORMAT_HINT})")
        if not record["completion"].strip():
            raise MeshrunError(f"{where}: an empty completion: nothing to train on (hint: drop the record)")
        return record
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise MeshrunError(f"{where}: 'messages' is {'an empty list' if messages == [] else type(messages).__name__},"
                           f" not a list of turns (hint: {FORMAT_HINT})")
    assistant = False
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise MeshrunError(f"{where}: message {k} is not an object with a role (hint: {FORMAT_HINT})")
        role = message["role"]
        if role not in ROLES:
            raise bad_value(f"{where}: message {k}'s role", role, "unknown role", f"one of {', '.join(ROLES)}")
        if not _content_ok(message):
            got_type = type(message.get("content")).__name__ if "content" in message else "missing"
            raise MeshrunError(f"{where}: message {k} ({role}): its content is {got_type}, not text "
                               "(hint: a string; a turn of parts or images is not read)")
        if role == "assistant":
            if not (message.get("content") or "").strip() and not message.get("tool_calls"):
                raise MeshrunError(f"{where}: message {k} (assistant) is empty: nothing to train on "
                                   "(hint: drop the turn, or the record)")
            assistant = True
    if not assistant:
        raise MeshrunError(f"{where}: a conversation without an assistant turn: nothing to train on "
                           "(hint: drop the record, or give it the assistant's reply)")
    return record


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template: its text, where it was read, its hash (recorded with the
    tokens and in the cache key), and the special tokens it is rendered with."""

    text: str
    source: str
    sha256: str
    tokens: tuple[tuple[str, str], ...]  # (bos_token, "<s>"), ... as tokenizer_config.json names them

    @property
    def generation(self) -> bool:
        """Whether it marks the assistant's text with ``{% generation %}``."""
        return GENERATION_TAG.search(self.text) is not None


def _config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        raise MeshrunError(f"{path}: not a readable JSON file (hint: save the tokenizer again)") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_template(tokenizer: str, where: str = "--tokenizer") -> ChatTemplate | None:
    """The chat template of the tokenizer ``tokenizer`` names (its directory, or the directory of
    its tokenizer.json), None when it has none (a tiktoken encoding has none)."""
    path = os.path.expanduser(tokenizer)
    if os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(path):
        return None
    config = _config(path)
    text, source = None, ""
    jinja = os.path.join(path, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                text, source = f.read(), jinja
        except (OSError, UnicodeDecodeError) as exc:
            raise bad_value(where, tokenizer, f"{jinja} cannot be read ({exc})", "save the tokenizer again") from None
    else:
        value = config.get("chat_template")
        if isinstance(value, list):  # named templates: the default one
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"),
                         None)
        if isinstance(value, str):
            text, source = value, os.path.join(path, CONFIG_FILE)
    if not text:
        return None
    tokens = tuple((name, t) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if (t := _token_text(config.get(name))) is not None)
    return ChatTemplate(text, os.path.abspath(source), hashlib.sha256(text.encode()).hexdigest(), tokens)


class Renderer:
    """A chat template compiled in jinja2's immutable sandbox, with the names templates use
    (``raise_exception``, ``strftime_now``, ``tojson``, loop controls, ``{% generation %}``)."""

    def __init__(self, template: ChatTemplate) -> None:
        try:
            import jinja2
            from jinja2 import nodes
            from jinja2.ext import Extension
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise MeshrunError(f"{template.source}: a chat template needs jinja2, not installed here "
                               "(hint: pip install 'meshrun[data]')") from None
        self.template = template
        # Each render marks a generation block's text with markers of its own, found and removed after
        self.open, self.close = f"\x00gen{secrets.token_hex(8)}\x01", f"\x00end{secrets.token_hex(8)}\x01"
        renderer = self

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

            def _mark(self, caller: Any) -> str:
                return renderer.open + str(caller()) + renderer.close

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            import datetime

            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        self.errors: tuple[type[Exception], ...] = (jinja2.exceptions.TemplateError, TypeError, ValueError,
                                                    KeyError, AttributeError, IndexError)
        try:
            self.compiled = env.from_string(template.text)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise MeshrunError(f"{template.source}: the chat template does not parse: line {exc.lineno}: "
                               f"{first_line(str(exc), 160)} (hint: fix the template, or save the tokenizer "
                               "again)") from None

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, where: str) -> str:
        """The template's text of ``messages`` (generation blocks still marked)."""
        try:
            return str(self.compiled.render(messages=messages, add_generation_prompt=generation_prompt,
                                            **dict(self.template.tokens)))
        except self.errors as exc:
            raise MeshrunError(f"{where}: the chat template ({self.template.source}) fails on it: "
                               f"{first_line(str(exc), 160) or type(exc).__name__} (hint: a conversation the template "
                               "takes: its roles in the order it expects)") from None

    def unmark(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """``text`` without the generation markers, and the spans they enclosed in it."""
        spans, out, pos = [], [], 0
        while True:
            start = text.find(self.open, pos)
            if start < 0:
                out.append(text[pos:])
                break
            end = text.find(self.close, start)
            out.append(text[pos:start])
            base = sum(map(len, out))
            body = text[start + len(self.open):end]
            out.append(body)
            spans.append((base, base + len(body)))
            pos = end + len(self.close)
        return "".join(out), spans

    def _opening(self, where: str) -> str:
        """What the template renders before a conversation's first turn when that turn is the
        assistant's (a default system prompt, the generation prompt); nothing for a template that
        does not take an empty conversation."""
        try:
            return self.render([], True, where)
        except MeshrunError:
            return ""

    def trained_spans(self, messages: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of it that are trained (the module's rule)."""
        whole = self.render(messages, False, where)
        if self.template.generation:
            text, spans = self.unmark(whole)
            if not spans:
                raise MeshrunError(f"{where}: the chat template marks no assistant text with {{% generation %}} "
                                   f"in it (hint: a template whose generation blocks hold the assistant's turns)")
            return text, [s for s in spans if s[1] > s[0]]
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], True, where) if k else self._opening(where)
            through = self.render(messages[:k + 1], False, where)
            if not through.startswith(before) or not whole.startswith(through):
                raise MeshrunError(f"{where}: the chat template does not render the conversation up to message {k} "
                                   "as the start of the whole (hint: a template that renders turns one after "
                                   "another, or one with {% generation %} tags)")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return whole, spans


def token_mask(encode: Any, text: str, spans: list[tuple[int, int]], where: str) -> tuple[list[int], np.ndarray]:
    """The tokens of ``text`` and a mask of those inside ``spans`` (character spans): each
    boundary's text before it, tokenized alone, must give the first tokens of the whole."""
    bounds = sorted({b for span in spans for b in span} - {0, len(text)})
    encoded = encode([text, *(text[:b] for b in bounds)])
    ids, at = encoded[0], {0: 0, len(text): len(encoded[0])}
    for b, prefix in zip(bounds, encoded[1:]):
        if list(ids[:len(prefix)]) != list(prefix):
            raise MeshrunError(f"{where}: a token spans the boundary of an assistant turn at character {b} of the "
                               "rendered conversation, so its loss mask is not exact (hint: a chat template whose "
                               "turns begin and end with special tokens)")
        at[b] = len(prefix)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[at[a]:at[b]] = 1
    return list(ids), mask


def encode_example(encode: Any, eos_id: int, renderer: Renderer | None, kind: ChatKind, record: dict[str, Any],
                   where: str) -> tuple[list[int], np.ndarray]:
    """A record's tokens and loss mask (1: trained), by the module's rule."""
    if kind == "prompt-completion":
        prompt, completion = encode([record["prompt"], record["completion"]])
        ids = [*prompt, *completion, eos_id]
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[len(prompt):] = 1
        return ids, mask
    if renderer is None:
        raise MeshrunError(f"{where}: a conversation needs the tokenizer's chat template")
    text, spans = renderer.trained_spans(record["messages"], where)
    ids, mask = token_mask(encode, text, spans, where)
    if not mask.any():
        raise MeshrunError(f"{where}: the chat template renders no assistant text for it (hint: check the "
                           "template's assistant turns)")
    return ids, mask


def needs_template(kind: ChatKind | None) -> bool:
    return kind == "messages"


def no_template(tokenizer: str, where: str) -> MeshrunError:
    """The line for conversations given a tokenizer without a chat template."""
    return bad_value(where, tokenizer, f"has no chat template ({CONFIG_FILE}'s chat_template or {TEMPLATE_FILE}), "
                     "and the data are conversations ('messages')",
                     "a tokenizer directory with a chat template, or the data as prompt/completion records")
