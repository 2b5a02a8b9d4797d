"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice or a grammar.

Each constrained request gets a ``GrammarMatcher`` (an ``llguidance.LLMatcher``): before a draw, the
sampler sets the logits of every token the grammar forbids to -inf (``allowed_tokens``); after it, the
scheduler feeds the drawn token to the matcher (``accept``) and finishes the request with "stop" once
the grammar is complete (``is_terminated``). Grammar compilation and token masks are llguidance's
(the library behind vLLM's and llama.cpp's ``guidance`` backends); this module only adapts it.
Source: vLLM v1 ``StructuredOutputsParams`` (field names) and ``structured_output/backend_guidance.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvgen.tokenizer import Tokenizer

# Whitespace between JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs of indentation
# (llama.cpp's json-schema-to-grammar ``space`` rule). llguidance's default, any run of whitespace, lets a small
# model emit newlines until max_tokens.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"

# JSON schema keywords whose value is a subschema or a list of them, and those whose value maps names to subschemas
# (vLLM backend_guidance's _SUBSCHEMA_KEYWORDS, _SCHEMA_MAP_KEYWORDS): where ``_patterns`` looks for regexes
_SUBSCHEMA_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
                       "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "allOf",
                       "anyOf", "oneOf")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one field is set (vLLM ``StructuredOutputsParams``).

    ``json``: a JSON schema (dict, or its JSON text); ``regex``: a regular expression (Rust ``regex``
    syntax); ``choice``: one of these strings exactly; ``grammar``: a Lark or GBNF (llama.cpp) grammar;
    ``json_object``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
    Raises ``ValueError`` when none or several are set, or for a value of the wrong type.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or JSON text), got {value!r}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                                 or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")

    def to_llguidance(self) -> str:
        """The llguidance grammar of the constraint. Raises ``ValueError`` for JSON text that does not parse or is
        no object, a dict that is no JSON data, or a regex (or a schema's pattern) that ends in a lone backslash."""
        from llguidance import LLMatcher, grammar_from

        if self.json is not None:
            schema = _json_data(self.json)
            if not isinstance(schema, dict):  # llguidance: "Expecting object schema to apply options"
                raise ValueError(f"the json schema must be a JSON object, got {self.json!r}")
            if bad := next((p for p in _patterns(schema) if _ends_in_lone_backslash(p)), None):
                raise ValueError(f"the json schema's pattern {bad!r} ends in an incomplete escape (a lone backslash)")
            return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_pattern": JSON_WHITESPACE})
        if self.regex is not None:
            if _ends_in_lone_backslash(self.regex):  # llguidance drops it and matches the rest
                raise ValueError(f"regex {self.regex!r} ends in an incomplete escape (a lone backslash)")
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # one terminal (a lexeme), not llguidance's "choice" (one rule alternative each), whose parser row
            # holds at most 2000 items: 2000 choices or more failed at the first token
            return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, self.choice)))
        assert self.grammar is not None  # __post_init__: exactly one field is set
        return grammar_from("grammar", self.grammar)


def _json_data(schema: dict[str, Any] | str) -> Any:
    """The schema as JSON data: its text parsed, or the dict after a round trip through JSON text. Raises
    ``ValueError`` for text that does not parse, or a dict that holds itself (llguidance's conversion of it
    overflowed the stack: a segfault), a value JSON has not (a set, NaN) or nesting too deep to encode."""
    try:
        return json.loads(schema if isinstance(schema, str) else json.dumps(schema, allow_nan=False))
    except json.JSONDecodeError as e:
        raise ValueError(f"the json schema is not valid JSON: {e}") from None
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"the json schema is not JSON data: {e}") from None


def _ends_in_lone_backslash(regex: str) -> bool:
    """An incomplete escape at the end: Python's re and Rust's regex refuse it, llguidance drops it."""
    return (len(regex) - len(regex.rstrip("\\"))) % 2 == 1


def _patterns(schema: dict[str, Any]) -> list[str]:
    """The regexes of a JSON schema (JSON data): each subschema's ``pattern`` and ``patternProperties`` names."""
    found: list[str] = []
    todo: list[Any] = [schema]
    while todo:  # a loop, not recursion: as deep as json.loads parses
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            found += [node["pattern"]] if isinstance(node.get("pattern"), str) else []
            found += list(node["patternProperties"]) if isinstance(node.get("patternProperties"), dict) else []
            todo.extend(node.get(key) for key in _SUBSCHEMA_KEYWORDS)
            todo.extend(v for key in _SCHEMA_MAP_KEYWORDS if isinstance(node.get(key), dict) for v in node[key].values())
    return found


class GrammarMatcher:
    """One request's position in its grammar (an ``llguidance.LLMatcher``)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def allowed_tokens(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (EOS ids once it may end); none once the matcher is in
        error (llguidance's mask then allows EOS, which would end a failed grammar as a complete output)."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(V / 32)]
        if self._matcher.is_error():  # the mask computation itself can fail (a $ref cycle: NoExtensionBias)
            return torch.zeros(self.vocab_size, dtype=torch.bool)  # [V]
        bits = (words.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1  # [ceil(V / 32), 32]
        return bits.view(-1)[: self.vocab_size].bool()  # [V]

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar forbids it or the matcher is in error (a matcher in
        error still takes EOS)."""
        return bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or in error): no token but EOS may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        """Why the matcher failed (the first line of llguidance's message, without its dump of parser state), or
        an empty string."""
        return str(self._matcher.get_error()).split("\n", 1)[0].strip()


class GrammarCompiler:
    """Builds ``GrammarMatcher``s for one tokenizer; ``vocab_size`` is the model's (logits width).

    The llguidance tokenizer is built on first use (~0.25 s for a 49k vocabulary), once per engine.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer: Any = None

    def prepare(self) -> None:
        """Build the llguidance tokenizer now if it is not built yet (:meth:`matcher` does on first use)."""
        from llguidance import LLTokenizer

        if self._ll_tokenizer is None:
            eos = self.tokenizer.eos_token_ids
            self._ll_tokenizer = LLTokenizer(self.tokenizer.backend_json(), n_vocab=self.vocab_size,
                                             eos_token=eos or None)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of ``params``' grammar. Raises ``ValueError`` naming what is wrong with
        the schema, regex or grammar."""
        from llguidance import LLMatcher

        self.prepare()
        try:
            grammar = params.to_llguidance()
        except ValueError as e:  # JSON text that does not parse, a GBNF grammar that does not convert
            raise ValueError(f"structured_outputs do not compile: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if is_error:  # (warnings alone do not refuse a grammar)
            raise ValueError(f"structured_outputs do not compile: {messages[0]}")
        matcher = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs do not compile: {matcher.get_error()}")
        grammar_matcher = GrammarMatcher(matcher, self.vocab_size)
        if not grammar_matcher.allowed_tokens().any():  # some grammars fail at their first mask ({"$ref": "#"})
            raise ValueError(f"structured_outputs do not compile: no first token is allowed ({grammar_matcher.error})")
        return grammar_matcher
