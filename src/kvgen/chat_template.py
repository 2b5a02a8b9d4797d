"""Chat templates: compiled and rendered the way transformers does (jinja2 sandbox).

Source: transformers ``utils/chat_template_utils.py`` (environment, filters, globals).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvgen.errors import KvgenError, ModelFormatError


class ChatTemplateError(KvgenError):
    """Messages that a chat template rejects (bad roles, missing fields, ``raise_exception``)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-span marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers overrides it with this.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def read_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (vLLM's ``--chat-template``): the file's
    text when ``value`` names a file, else ``value`` when it holds Jinja (``{``, ``}`` or a newline). Raises
    ``ValueError`` naming the value otherwise, or when the file cannot be read as UTF-8."""
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # a one-line template over the OS's name limit (ENAMETOOLONG), a NUL: no file
        is_file = False
    path = Path(value)
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read {value}: {e}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' environment. Raises ``ModelFormatError`` on a syntax error.

    Source: transformers ``utils/chat_template_utils.py::_compile_jinja_template``.
    """
    extensions = [_GenerationTag, jinja2.ext.loopcontrols]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFormatError(f"chat template does not compile (line {e.lineno}): {e.message}") from None


def check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")


def check_documents(documents: Any) -> list[dict[str, Any]] | None:
    """``documents`` (a chat template's RAG sources) as given: None or a list of dicts. Raises ``ValueError``
    otherwise, as transformers' ``apply_chat_template`` refuses them (its ``TypeError``)."""
    if documents is not None and (not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)):
        raise ValueError(f"documents must be a list of dicts (such as {{'title': ..., 'text': ...}}), got {documents!r:.200}")
    return documents


_TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")

ContentFormat = Literal["string", "openai"]  # how a chat template takes a message's content (vLLM's names)


@lru_cache(maxsize=32)
def detect_content_format(source: str) -> ContentFormat:
    """How a chat template takes a message's ``content``: "openai", a list of ``{"type": "text", "text": ...}`` parts,
    when it loops over it (``{% for part in message['content'] %}``, ``message`` a loop variable over ``messages`` or
    over a variable set from it: Llama 3.2 Vision, Qwen2-VL, Pixtral, SmolVLM), else "string" (also for a template
    that does not compile). Source: vLLM ``renderers/hf.py::_detect_content_format``."""
    try:
        root = compile_chat_template(source).environment.parse(source)
    except (ModelFormatError, jinja2.TemplateError):
        return "string"
    message_names = set(_loop_targets(root, _names_set_from(root, "messages"), None))
    return "openai" if any(True for _ in _loop_targets(root, message_names, "content")) else "string"


def _names_set_from(root: jinja2.nodes.Template, name: str) -> set[str]:
    """``name`` and the variables set from it, its slices or filters, transitively (``{% set m = messages[1:] %}``)."""
    names, pending = {name}, [name]
    while pending:
        current = pending.pop()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in names and _reads(assign.node, current, None):
                names.add(target.name)
                pending.append(target.name)
    return names


def _loop_targets(root: jinja2.nodes.Template, names: set[str], key: str | None) -> Iterator[str]:
    """The loop variables of ``{% for x in NAME %}`` (``{% for x in NAME[key] %}`` with a ``key``) over ``names``."""
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, n, key) for n in names):
            yield loop.target.name


def _reads(node: jinja2.nodes.Node, name: str, key: str | None) -> bool:
    """Whether ``node`` is ``name`` (``name['key']`` or ``name.key`` with a ``key``), through filters, tests and
    slices."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _is_name(node.node, name)
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == key and _is_name(node.node, name)


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def template_messages(messages: list[dict[str, Any]], content_format: ContentFormat = "string") -> list[dict[str, Any]]:
    """OpenAI-style messages as vLLM hands them to a chat template (``parse_chat_messages``, text only; ``LLM.chat``
    and the server): the content as :func:`template_content` gives it in ``content_format``, tool-call arguments given
    as JSON text parsed (:func:`template_arguments`), an assistant's ``reasoning`` also as ``reasoning_content`` (the
    name Qwen3's templates read). Other keys and other contents are kept; ``messages`` is not modified."""
    return [_template_message(m, content_format) if isinstance(m, dict) else m for m in messages]


def _template_message(message: dict[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    out = dict(message)
    out["content"] = template_content(message.get("content"), content_format, is_tool=message.get("role") == "tool")
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": template_arguments(
            c["function"].get("arguments"))}} if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
            for c in calls]
    if message.get("reasoning") is not None and "reasoning_content" not in message:
        out["reasoning_content"] = message["reasoning"]
    return out


def template_content(content: Any, content_format: ContentFormat, is_tool: bool = False) -> Any:
    """A message's content (a string, None, or a list of text parts) as vLLM hands it to a chat template: "string",
    the parts' texts joined with newlines ("" for None or no parts); "openai", a list of ``{"type": "text", "text":
    ...}`` parts (a string is one part, None none), but a tool message's texts joined as "string". Parts without text
    are dropped; any other content (an image part, a number) is kept as given.
    Source: vLLM ``entrypoints/chat_utils.py::_parse_chat_message_content``."""
    parts = [] if content is None else [content] if isinstance(content, str) else content
    if not isinstance(parts, list) or not all(_is_text_part(p) for p in parts):
        return content
    texts = [p if isinstance(p, str) else p[_part_key(p)] for p in parts]
    texts = [t for t in texts if t is not None]
    if content_format == "openai" and not is_tool:
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _is_text_part(part: Any) -> bool:
    """A plain string, or a text part (``{"type": "text", "text": ...}``, a refusal ...) whose text is a string or
    None."""
    if isinstance(part, str):
        return True
    return isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get(_part_key(part)),
                                                                                           str | None)


def _part_key(part: dict[str, Any]) -> str:
    return "refusal" if part.get("type") == "refusal" else "text"


def template_arguments(arguments: Any) -> Any:
    """A tool call's arguments as chat templates take them (``arguments | tojson``): JSON text parsed, ``{}`` for
    text that is no JSON or a value that is neither an object nor a list. Source: vLLM ``_postprocess_messages``."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict | list) else {}
