"""The stored responses behind `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`: in
memory, bounded (the least recently used goes first), lost when the server stops."""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.responses_protocol import ResponseObject

DEFAULT_CAPACITY = 256


@dataclass
class StoredResponse:
    response: ResponseObject
    # The conversation so far as chat messages (this turn's input and output included, the
    # instructions not: a new response gives its own), for a later turn to continue.
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response, or a 404 naming the id (and `param`, the field that gave it)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"no stored response with id '{response_id}' (responses are kept in memory, "
                f"the last {self.capacity}, until the server restarts; store: false keeps none)",
                param=param,
                code="response_not_found",
            )
        self._entries.move_to_end(response_id)
        return entry

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored response's output item by its id (what an `item_reference` names)."""
        for entry in self._entries.values():
            for item in entry.response.output:
                if item.id == item_id:
                    return item.model_dump()
        return None

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]
