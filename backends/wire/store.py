"""The Responses API's stored answers: with `store` (OpenAI's default) an answer is kept with the
conversation it ends, so that a request may continue it (`previous_response_id`) and a client may
read or delete it. In memory only: a restart forgets them. Each API key sees only its own.

Bounded by what it holds (issue 65): each answer is kept as its JSON text (bytes), which is what
RESPONSES_STORE_BYTES counts (the parsed objects kept before held ~17 times the JSON bytes
counted), and at most RESPONSES_STORE answers. Past a limit the oldest answer of the key holding
the most goes first, so one key's answers cannot push out another's while it holds more.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from functools import cached_property
from typing import Any

from backends.wire.errors import ApiError

OVERHEAD = 256  # bytes an entry costs besides its JSON (its objects and keys), counted with it


class Stored:
    """A kept answer: the response as it was given, and the conversation it ends (its input
    items, a continued one's too, then its output), parsed when first read."""

    def __init__(self, response: bytes, items: bytes):
        self.response_json = response
        self.items_json = items
        self.size = len(response) + len(items) + OVERHEAD

    @cached_property
    def response(self) -> dict:
        return json.loads(self.response_json)

    @cached_property
    def items(self) -> list[dict]:
        return json.loads(self.items_json)


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class ResponseStore:
    """At most `entries` answers and `size` bytes, per namespace (an API key's) and id."""

    def __init__(self, entries: int, size: int):
        self.entries, self.size = entries, size
        self._kept: dict[str, OrderedDict[str, Stored]] = {}
        self._bytes: dict[str, int] = {}
        self.held = 0  # bytes, all keys together

    def put(self, namespace: str, response: dict, items: list[dict]) -> None:
        entry = Stored(compact(response), compact(items))
        if self.entries <= 0 or entry.size > self.size:
            return
        self.delete(namespace, response["id"])
        self._kept.setdefault(namespace, OrderedDict())[response["id"]] = entry
        self._bytes[namespace] = self._bytes.get(namespace, 0) + entry.size
        self.held += entry.size
        while self.held > self.size or self.count > self.entries:
            by = self._bytes if self.held > self.size else {n: len(k) for n, k in self._kept.items()}
            largest = max(by, key=by.__getitem__)
            self._remove(largest, next(iter(self._kept[largest])))

    @property
    def count(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def get(self, namespace: str, response_id: str) -> Stored | None:
        kept = self._kept.get(namespace)
        found = kept.get(response_id) if kept else None
        if found is not None:
            kept.move_to_end(response_id)
        return found

    def delete(self, namespace: str, response_id: str) -> bool:
        if response_id not in self._kept.get(namespace, ()):
            return False
        self._remove(namespace, response_id)
        return True

    def _remove(self, namespace: str, response_id: str) -> None:
        entry = self._kept[namespace].pop(response_id)
        self._bytes[namespace] -= entry.size
        self.held -= entry.size
        if not self._kept[namespace]:
            del self._kept[namespace], self._bytes[namespace]


def stored(store: ResponseStore, namespace: str, response_id: str, field: str | None = None) -> Stored:
    """A stored answer of this namespace (an API key's), or OpenAI's 404 for an id it does not know."""
    found = store.get(namespace, response_id)
    if found is None:
        kind = "Previous response" if field else "Response"
        code = "previous_response_not_found" if field else None
        raise ApiError(404, f"{kind} with id {response_id!r} not found.", field=field, code=code)
    return found
