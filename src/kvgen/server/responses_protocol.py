"""Pydantic models of OpenAI's Responses API (``POST /v1/responses``) as kvgen serves it.

Input items: messages (a string or ``input_text`` / ``output_text`` parts; a previous response's output
items are taken back as they are), ``function_call`` and ``function_call_output``. Tools are function
tools. Fields a local model cannot honour (hosted tools, images, background mode, reasoning effort,
conversations, prompt templates) are refused with a 400 naming them; unknown fields too.
Source: OpenAI API reference, Responses (create, retrieve, delete, list input items; streaming events); vLLM
``vllm/entrypoints/openai/protocol.py::ResponsesRequest``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
)

from kvgen.server.protocol import (
    MAX_TOP_LOGPROBS,
    ChatTokenLogprob,
    JsonSchemaFormat,
    Metadata,
    StrictModel,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value served
# OpenAI's ``IncludeEnum``: what ``GET .../input_items`` may be asked to include; none is in kvgen's items (no images,
# no hosted tools, no logprobs of input text), so each is accepted and changes nothing
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", LOGPROBS_INCLUDE)
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputTextPart(BaseModel):
    """A text part of an input message: ``input_text`` (user, system) or ``output_text`` (a previous reply, whose
    ``annotations`` / ``logprobs`` are ignored)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: str


class _InputItem(StrictModel):
    """An input item; ``id`` / ``status`` (present when a previous response's output item is given back) are
    accepted and ignored."""

    id: str | None = None
    status: str | None = None


class MessageItem(_InputItem):
    """A message: text, or text parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(_InputItem):
    """A call the model made (an earlier output item), given back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text


class FunctionCallOutputItem(_InputItem):
    """The caller's answer to a ``function_call`` with the same ``call_id``: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_InputItem):
    """A reasoning item of an earlier response (``--reasoning-parser``), given back: the assistant turn after it
    carries its text."""

    type: Literal["reasoning"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return f"item-{kind}"  # a tag with "-": error locations skip it (``errors._loc_param``)


# an item's ``type`` picks its model (a message may leave it out), so an error names that model's field
InputItem = Annotated[
    Annotated[MessageItem, Tag("item-message")] | Annotated[FunctionCallItem, Tag("item-function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item-function_call_output")] | Annotated[ReasoningItem, Tag("item-reasoning")],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="type must be 'message', 'function_call', 'function_call_output' or 'reasoning'"),
]


class FunctionTool(StrictModel):
    """A function tool in the Responses form (flat: no ``function`` wrapper as in chat completions)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema`` (its ``name`` required). Echoed in a
    response with the fields it has: OpenAI's formats have no null fields (``{"type": "text"}``; a json_schema format's
    ``description`` is a string if there)."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> Any:
        return {k: v for k, v in handler(self).items() if v is not None}

    def as_json_schema(self) -> JsonSchemaFormat | None:
        if self.type != "json_schema" or self.name is None or self.schema_ is None:
            return None
        return JsonSchemaFormat.model_validate({"name": self.name, "description": self.description,
                                                "schema": self.schema_, "strict": self.strict})


class TextConfig(StrictModel):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # accepted; kvgen never pads its events


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``. ``store`` (default true) keeps the response for ``GET /v1/responses/{id}`` and for a
    later ``previous_response_id``, in a bounded in-memory store (as vLLM). ``model`` may be left out (the served
    model), as vLLM allows."""

    nullable_fields: ClassVar[tuple[str, ...]] = ("stream", "store")  # OpenAI's CreateResponse lets them be null

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    metadata: Metadata | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None


def _now() -> int:
    return int(time.time())


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)  # OpenAI: an array, empty unless asked


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(BaseModel):
    """The reply's chain of thought (``kvgen serve --reasoning-parser``), before its message."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cache_write_tokens: int = 0  # OpenAI's (required in its schema): tokens written to an explicit cache; none here
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error", "invalid_prompt"]  # of OpenAI's ResponseErrorCode enum, the two kvgen can give
    message: str


class ResponseObject(BaseModel):
    """The response object (``object: "response"``), echoing the request's settings as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None  # OpenAI's: when it completed, with status "completed" only
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float = 1.0
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float = 1.0
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputText(BaseModel):
    type: Literal["input_text"] = "input_text"
    text: str


class InputMessageResource(BaseModel):
    """A user, system or developer message of a response's input, as ``GET .../input_items`` lists it."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["user", "system", "developer"]
    content: list[InputText]
    status: ItemStatus = "completed"


class FunctionCallOutputResource(BaseModel):
    type: Literal["function_call_output"] = "function_call_output"
    id: str
    call_id: str
    output: str | list[InputText]
    status: ItemStatus = "completed"


# an input item as listed: an assistant message, a function call or a reasoning item has its output item's shape
ListedItem = InputMessageResource | OutputMessage | OutputFunctionCall | FunctionCallOutputResource | OutputReasoning


class ResponseItemList(BaseModel):
    """``GET /v1/responses/{id}/input_items``: a page of the items a response was generated from. ``first_id`` and
    ``last_id`` are null for an empty page (OpenAI's schema types them as strings and says nothing of an empty page)."""

    object: Literal["list"] = "list"
    data: list[ListedItem]
    first_id: str | None
    last_id: str | None
    has_more: bool
