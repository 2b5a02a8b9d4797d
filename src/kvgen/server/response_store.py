"""The in-memory store of ``/v1/responses`` results kept for ``GET /v1/responses/{id}`` (and its ``input_items``) and
``previous_response_id`` (as vLLM's: lost on restart, bounded by a count, and by bytes since a request's tools
and user have no length limit)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvgen.server.errors import OpenAIError
from kvgen.server.protocol import ChatMessage
from kvgen.server.responses_protocol import ListedItem, ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[ChatMessage]  # the conversation through this response's output, without its instructions
    items: list[list[ListedItem]] = field(default_factory=list)  # for each message, the items it came from

    def input_items(self) -> list[ListedItem]:
        """The items the response was generated from, oldest first: those of its (kept) conversation before its
        output."""
        return [item for turn in self.items[:-1] for item in turn]


class ResponseStore:
    """The last ``capacity`` stored responses by id, at most ``max_bytes`` of JSON in all (least recently stored or
    read dropped first; one entry over ``max_bytes`` is not kept)."""

    def __init__(self, capacity: int = 1024, max_bytes: int = 256 << 20) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0  # the entries' sizes (``entry_size``) summed
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """Raises a 404 ``OpenAIError`` naming ``param`` for an unknown id."""
        item = self._entries.get(response_id)
        if item is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", param, "not_found")
        self._entries.move_to_end(response_id)
        return item[0]

    def put(self, entry: StoredResponse) -> None:
        response_id = entry.response.id
        if response_id in self._entries:
            self._drop(response_id)
        size = entry_size(entry)
        self._entries[response_id] = (entry, size)
        self.num_bytes += size
        while len(self._entries) > self.capacity or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        self.num_bytes -= self._entries.pop(response_id)[1]


def entry_size(entry: StoredResponse) -> int:
    """Bytes of the entry as JSON (its response, each message and each item; those shared with another entry, as a
    chain's are, count in each)."""
    return (len(entry.response.model_dump_json()) + sum(len(m.model_dump_json()) for m in entry.messages)
            + sum(len(item.model_dump_json()) for turn in entry.items for item in turn))
