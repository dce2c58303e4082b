"""The stored responses of /v1/responses (`store`, the default): what `previous_response_id` continues
and GET/DELETE /v1/responses/{id} read.

An in-memory LRU bounded by a count of responses: per process, lost at restart, and each entry holds its
whole conversation (its input items, earlier turns included, and its output).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as it was returned
    input_items: list[dict[str, Any]]  # the conversation before its output: earlier turns, then its input

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from: the input, then the output."""
        return [*self.input_items, *self.response["output"]]


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        """Keep `stored`; past the bound, the least recently used response is forgotten."""
        response_id = stored.response["id"]
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""
        return self._responses.pop(response_id, None) is not None
