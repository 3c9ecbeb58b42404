"""The Responses API's stored answers: with `store` (OpenAI's default) an answer is kept with the
conversation it ends, so that a request may continue it (`previous_response_id`) and a client may
read or delete it. Bounded (RESPONSES_STORE entries, RESPONSES_STORE_BYTES of JSON, least recently
used out first) and in memory only: a restart forgets them. Each API key sees only its own."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from backends.wire.errors import ApiError


@dataclass
class Stored:
    response: dict  # the answer as it was given
    items: list[dict]  # the conversation it ends: its input items (a continued one's too), then its output
    size: int  # bytes of JSON, what the store counts


class ResponseStore:
    def __init__(self, entries: int, size: int):
        self.entries, self.size = entries, size
        self._kept: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._bytes = 0

    def put(self, namespace: str, response: dict, items: list[dict]) -> None:
        size = len(json.dumps([response, items]))
        if self.entries <= 0 or size > self.size:
            return
        self._kept[namespace, response["id"]] = Stored(response, items, size)
        self._bytes += size
        while len(self._kept) > self.entries or self._bytes > self.size:
            self._bytes -= self._kept.popitem(last=False)[1].size

    def get(self, namespace: str, response_id: str) -> Stored | None:
        found = self._kept.get((namespace, response_id))
        if found is not None:
            self._kept.move_to_end((namespace, response_id))
        return found

    def delete(self, namespace: str, response_id: str) -> bool:
        found = self._kept.pop((namespace, response_id), None)
        self._bytes -= found.size if found else 0
        return found is not None


def stored(store: ResponseStore, namespace: str, response_id: str, field: str | None = None) -> Stored:
    """A stored answer of this namespace (an API key's), or OpenAI's 404 for an id it does not know."""
    found = store.get(namespace, response_id)
    if found is None:
        kind = "Previous response" if field else "Response"
        code = "previous_response_not_found" if field else None
        raise ApiError(404, f"{kind} with id {response_id!r} not found.", field=field, code=code)
    return found
