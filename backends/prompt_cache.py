"""Prompt (prefix) KV reuse for the Torch runtime: token-id prefixes whose keys and values a
decoder still holds, least recently used out first, within a byte budget.

mlx-lm has this machinery for MLX (`LRUPromptCache`, which the MLX runtime uses); it imports
MLX, which the Torch-only image does not have, so the Torch decoders use this small equivalent.
An entry is the KV of its ids for every layer, `k` and `v` of shape [layers, heads, n, head_dim]
(both Torch decoders lay a sequence's cache out that way). Matching is on token ids, longest
common prefix, and a match may end inside an entry: its first m positions are reused ("trim,
don't discard"). Entries are few (a budget of KV, hundreds of KiB a token for Phi-2), so a
linear scan finds the longest match.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from backends import PromptCacheUsage


@dataclass(frozen=True)
class Entry:
    ids: tuple[int, ...]
    k: Any  # torch.Tensor [layers, heads, len(ids), head_dim]
    v: Any
    nbytes: int


def common_prefix(a: tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == tuple(b[:n]):
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]: halve the gap
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == tuple(b[low:middle]):
            low = middle
        else:
            high = middle
    return low


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # oldest use first

    def usage(self) -> PromptCacheUsage:
        return PromptCacheUsage(self.budget_bytes, self.bytes, len(self._entries))

    def match(self, ids: list[int], limit: int) -> tuple[int, Entry | None]:
        """The longest prefix of `ids` (at most `limit` ids) held, and the entry holding it."""
        best, found = 0, None
        for entry in self._entries.values():
            n = common_prefix(entry.ids, ids[:limit])
            if n > best:
                best, found = n, entry
        if found is not None:
            self._entries.move_to_end(found.ids)
        return best, found

    def store(self, ids: list[int], nbytes: int, kv: Callable[[], tuple[Any, Any]]) -> None:
        """Hold the KV of `ids`; `kv()` copies it out of the decoder, only if it is kept.

        What an entry holds is never held twice: ids that an entry already starts with only
        refresh that entry, and entries that are prefixes of `ids` make way for it. Least
        recently used entries leave until the new one fits; one larger than the whole budget
        is not kept. The budget is never exceeded.
        """
        key = tuple(ids)
        if not key or self.budget_bytes <= 0 or nbytes > self.budget_bytes:
            return
        for entry in list(self._entries.values()):
            if entry.ids[: len(key)] == key:
                self._entries.move_to_end(entry.ids)
                return
            if key[: len(entry.ids)] == entry.ids:
                self._drop(entry)
        while self._entries and self.bytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries.values())))
        k, v = kv()
        self._entries[key] = Entry(key, k, v, nbytes)
        self.bytes += nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.ids]
        self.bytes -= entry.nbytes
