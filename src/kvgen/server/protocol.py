"""Pydantic request and response models of the OpenAI-compatible API.

Field names, defaults and ranges follow OpenAI's API reference (Chat Completions,
Completions, Models); extra sampling fields follow vLLM (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``). Unknown request fields
are refused (400 naming the field), as OpenAI does. Counts are in tokens.
Source: OpenAI openapi.yaml; vLLM ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from kvgen.chat_template import ContentFormat, template_arguments, template_content
from kvgen.tokenizer.tokenizer import lone_surrogate

MAX_N = 16  # completions per prompt; bounds one request's share of the engine
MAX_STOP = 16  # stop strings per request
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_INT32 = 2**31 - 1  # counts that become int64 tensor entries stay far from overflow


def json_lone_surrogate(value: Any) -> tuple[str, int] | None:
    """Where the first lone UTF-16 surrogate sits in a parsed JSON value (its strings and keys), as a path below it
    ("", "[2]", ".text", ".a[0]"), and its code point; None if there is none. JSON may escape one ("\\ud800"),
    Python's parser keeps it, and it is no Unicode text: UTF-8 (the tokenizer, the response) cannot encode it."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if (code_point := lone_surrogate(item)) is not None:
                return path, code_point
        elif isinstance(item, dict):
            for key, sub in reversed(item.items()):
                if isinstance(key, str) and (code_point := lone_surrogate(key)) is not None:
                    return f"{path} (a key)", code_point
                stack.append((f"{path}.{key}", sub))
        elif isinstance(item, list):  # (token ids: skipped without building anything)
            stack.extend((f"{path}[{i}]", item[i]) for i in range(len(item) - 1, -1, -1) if not isinstance(item[i], int))
    return None


class StrictModel(BaseModel):
    """A request object: unknown fields are refused, and so is text that is not Unicode (lone surrogates), and a
    number field's NaN or Infinity (JSON as Python reads it: NaN, Infinity, 1e400)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    nullable_fields: ClassVar[tuple[str, ...]] = ()  # fields a null value leaves at their default (a subclass's own)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A null ``nullable_fields`` value is left out, so the field keeps its default; only fields the model
        declares (chat has no ``echo``: a null one is still refused as unknown)."""
        nullable = [k for k in cls.nullable_fields if k in cls.model_fields]
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in nullable):
            return {k: v for k, v in data.items() if v is not None or k not in nullable}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _no_lone_surrogates(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, (str, list, dict)) and (found := json_lone_surrogate(value)) is not None:
            path, code_point = found
            raise ValueError(f"{info.field_name}{path} holds the lone surrogate U+{code_point:04X}, which is not "
                             "Unicode text")
        return value


# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------- shared request fields


class StreamOptions(StrictModel):
    """``include_usage``: a last chunk with the request's usage (``usage`` null on the others), as OpenAI;
    ``continuous_usage_stats`` (vLLM's extra, with ``include_usage`` only): every chunk carries its choice's usage so
    far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)] | None


class JsonSchemaFormat(StrictModel):
    """OpenAI ``response_format.json_schema``: the schema the output must match (``strict`` is always on here)."""

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI ``response_format``: plain text, any JSON object, or JSON matching ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM extra ``structured_outputs``: exactly one constraint (see ``kvgen.engine.StructuredOutputsParams``)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512 (its ``Metadata`` schema)
Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]
class SamplingFields(StrictModel):
    """Sampling fields shared by chat and text completions (OpenAI, then vLLM extras). ``model`` may be left out
    (the served model), as vLLM and llama.cpp's server allow."""

    # OpenAI's schemas let these be null, meaning their defaults (vLLM's fields are Optional with the same defaults)
    nullable_fields: ClassVar[tuple[str, ...]] = ("n", "stream", "logprobs", "echo")

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: Stop = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32, description="vLLM extra: 0 or -1 = off")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # bounded away from 0: logits / 1e-300 overflow to inf, and the draw fails
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT32)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_INT32,
                                               description="vLLM extra: keep the prompt's last k tokens; -1: max_model_len")
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-MAX_INT32 - 1, le=MAX_INT32,
                          description="vLLM extra: lower runs first (needs --scheduling-policy priority)")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(default=None, description="vLLM extra")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, description="vLLM extra")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM extra")
    skip_special_tokens: bool = Field(default=True, description="vLLM extra")
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=1 << 18,
                                                                         description="vLLM extra")
    bad_words: list[str] | None = Field(default=None, max_length=1024, description="vLLM extra")
    use_beam_search: bool = Field(default=False, description="vLLM extra: the n best beams of a beam search")
    length_penalty: float = Field(default=1.0, ge=-100.0, le=100.0, description="vLLM extra: beam score = "
                                  "cumulative logprob / tokens ** length_penalty (use_beam_search)")


# ---------------------------------------------------------------- chat completions


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer to that call
    reasoning: str | None = None  # an assistant turn's reasoning, as a reply with --reasoning-parser gave it


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none = any object
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = Field(default=True, description="vLLM extra: end the prompt with the assistant's turn")
    continue_final_message: bool = Field(default=False, description="vLLM extra: the model continues the last message")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="vLLM extra: chat template variables")
    documents: list[dict[str, str]] | None = Field(default=None, description="vLLM extra: the template's RAG documents")
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields accepted and ignored, as they change nothing a local server returns (clients and agent frameworks
    # send them); an unknown field is still a 400, as OpenAI's "Unrecognized request argument".
    store: bool | None = None
    metadata: Metadata | None = Field(default=None, max_length=16)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = Field(default=None, description="predicted output: a speed hint, ignored")
    modalities: list[Literal["text"]] | None = Field(default=None, description="only text is served")


class ChatCompletionMessage(BaseModel):
    """A reply as OpenAI gives it: ``refusal`` always there (null: kvgen never refuses), ``tool_calls`` only when the
    reply made calls (OpenAI's and vLLM's; an array when present, never null)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # vLLM extra (--reasoning-parser): the reply's chain of thought

    @model_serializer(mode="wrap")
    def _without_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None  # OpenAI's (required, null here: kvgen never refuses)


FinishReason = Literal["stop", "length", "tool_calls"]
# vLLM's extension of a choice: the stop string or stop token id that ended it (None: EOS, a length limit, running)
StopReason = int | str | None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache


class Usage(BaseModel):
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` as OpenAI sends it on every reply (vLLM behind
    ``--enable-prompt-tokens-details``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def _now() -> int:
    return int(time.time())


class _Envelope(BaseModel):
    """The fields every completion response and stream chunk starts with (OpenAI's order)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- text completions

PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=0, description="0 only with echo: the prompt alone")
    echo: bool = Field(default=False, description="put the prompt (and, with logprobs, its tokens' logprobs) first")
    logprobs: int | None = Field(default=None, ge=0, le=5, description="log-probabilities of the chosen token and the n best")
    suffix: str | None = Field(default=None, description="not supported: must be null")
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="only best_of == n is supported")


class CompletionLogprobs(BaseModel):
    """The legacy completions format: per generated token its text, logprob, the ``logprobs`` best alternatives plus
    the chosen one (token text -> logprob), and its character offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- models, tokenize, health


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvgen"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


MAX_EMBEDDING_INPUTS = 2048  # as OpenAI: inputs per /v1/embeddings request


class EmbeddingRequest(StrictModel):
    """OpenAI's /v1/embeddings: ``input`` is a string, a list of token ids, or a non-empty list of either (at most
    2048); ``dimensions`` keeps the first n values before normalizing; ``encoding_format`` "base64" sends each
    embedding as the base64 of its little-endian float32 bytes (what the ``openai`` client asks for). vLLM's
    ``EmbeddingChatRequest``: ``messages`` instead of ``input``, one embedding of the chat template's rendering
    (without the generation prompt and, unless ``add_special_tokens`` is set, without special tokens)."""

    model: str | None = None
    input: (str | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)] | list[Annotated[int, Field(ge=0)]]
            | Annotated[list[list[Annotated[int, Field(ge=0)]]], Field(max_length=MAX_EMBEDDING_INPUTS)] | None) = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1,
                                               description="vLLM extra: embed a conversation instead of input")
    add_generation_prompt: bool = Field(default=False, description="vLLM extra, with messages: end with the "
                                                                   "assistant's turn")
    continue_final_message: bool = Field(default=False, description="vLLM extra, with messages")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="vLLM extra, with messages")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_INT32,
                                               description="vLLM extra: embed each input's last k tokens; -1: max_model_len")
    add_special_tokens: bool = Field(default=True, description="vLLM extra: text inputs get the tokenizer's special "
                                                               "tokens (BOS) where the model's files ask for them "
                                                               "(with messages: false unless set)")

    @field_validator("input", mode="before")
    @classmethod
    def _at_most_max_inputs(cls, value: Any) -> Any:
        """Too many texts (or id lists) is said as such: the union's other branch, one list of token ids, would
        otherwise be the error ("input[0] should be a valid integer")."""
        if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS and isinstance(value[0], (str, list)):
            raise ValueError(f"input holds at most {MAX_EMBEDDING_INPUTS} inputs, got {len(value)}")
        return value


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 (encoding_format)
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeRequest(StrictModel):
    """Either ``prompt`` (text) or ``messages`` (through the chat template, with the chat request's
    ``continue_final_message``, ``chat_template_kwargs`` and ``tools``), as vLLM's /tokenize; ``return_token_strs``:
    also each token's vocabulary string."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    return_token_strs: bool | None = Field(default=False, description="vLLM extra: also the tokens' strings")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs (vLLM's)


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class VersionResponse(BaseModel):
    version: str  # kvgen's (vLLM's GET /version gives vLLM's)


def message_dicts(messages: list[ChatMessage], content_format: ContentFormat = "string") -> list[dict[str, Any]]:
    """Messages as the chat template takes them, as vLLM's ``parse_chat_messages`` hands them over: the content as
    :func:`kvgen.chat_template.template_content` gives it in ``content_format`` ("string": text parts joined with
    newlines; "openai": a list of text parts, for a template that loops over them), tool-call arguments parsed from
    their JSON text (``{}`` when it is none; templates expect objects: ``arguments | tojson``), reasoning also as
    ``reasoning_content`` (Qwen3's templates read that name); ``developer`` as ``system``."""
    out = []
    for m in messages:
        content = m.content if not isinstance(m.content, list) else [p.model_dump() for p in m.content]
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": template_content(content, content_format, is_tool=m.role == "tool")}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.reasoning is not None:
            entry["reasoning"] = entry["reasoning_content"] = m.reasoning
        out.append(entry)
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A tool call with its arguments as a JSON value, ``{}`` for text that is no JSON (vLLM's
    ``_postprocess_messages``)."""
    arguments = template_arguments(call.function.arguments)
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
