"""The in-memory store of ``/v1/responses`` results kept for ``GET /v1/responses/{id}`` and
``previous_response_id`` (as vLLM's: lost on restart, bounded by a count)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvgen.server.errors import OpenAIError
from kvgen.server.protocol import ChatMessage
from kvgen.server.responses_protocol import ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[ChatMessage]  # the conversation through this response's output, without its instructions


class ResponseStore:
    """The last ``capacity`` stored responses by id (least recently stored or read dropped first)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """Raises a 404 ``OpenAIError`` naming ``param`` for an unknown id."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", param, "not_found")
        self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]


