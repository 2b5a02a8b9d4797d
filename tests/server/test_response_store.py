"""kvgen.server.response_store without a model: the stored /v1/responses results' bounds."""

from __future__ import annotations

import pytest

from kvgen.server.errors import OpenAIError
from kvgen.server.protocol import ChatMessage
from kvgen.server.response_store import ResponseStore, StoredResponse, entry_size
from kvgen.server.responses_protocol import ResponseObject


def _entry(i: int, num_chars: int) -> StoredResponse:
    """A stored response whose metadata (no length limit) holds ``num_chars`` characters."""
    response = ResponseObject(id=f"resp_{i}", status="completed", model="tiny", metadata={"k": "x" * num_chars})
    return StoredResponse(response, [ChatMessage(role="user", content="Hi")])


def test_the_store_keeps_the_newest_entries_within_its_bytes():
    """Entries are also bounded in bytes (the oldest dropped): a client's metadata, tools or user have no length limit,
    and 1,024 entries of 10 MB of metadata each were all kept (10 GB)."""
    store = ResponseStore(capacity=1024, max_bytes=100_000)
    for i in range(10):
        store.put(_entry(i, 30_000))
    assert store.num_bytes <= 100_000 and store.num_bytes == sum(entry_size(_entry(i, 30_000)) for i in (7, 8, 9))
    assert store.get("resp_9").response.id == "resp_9"
    with pytest.raises(OpenAIError):
        store.get("resp_6")
    store.delete("resp_8")
    assert store.num_bytes == sum(entry_size(_entry(i, 30_000)) for i in (7, 9))
    store.put(_entry(10, 200_000))  # over the whole budget alone: not kept, and the others go
    assert store.num_bytes == 0
    with pytest.raises(OpenAIError):
        store.get("resp_10")


def test_the_store_keeps_the_last_capacity_entries_read_or_stored():
    store = ResponseStore(capacity=3)
    for i in range(3):
        store.put(_entry(i, 1))
    store.get("resp_0")  # read: now the newest
    store.put(_entry(3, 1))
    with pytest.raises(OpenAIError):
        store.get("resp_1")
    assert [store.get(f"resp_{i}").response.id for i in (0, 2, 3)] == ["resp_0", "resp_2", "resp_3"]
    assert store.num_bytes == sum(entry_size(_entry(i, 1)) for i in (0, 2, 3))
