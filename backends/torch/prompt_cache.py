"""Prompt (prefix) KV reuse for the Torch runtime: the keys and values of token ids a decoder
has computed, in a radix tree of token ids, least recently used leaves out first, within a
byte budget.

mlx-lm has this machinery for MLX (`LRUPromptCache`, which the MLX runtime uses); it imports
MLX, which the Torch-only image does not have, so the Torch decoders use this. Each node holds
a run of ids and their KV, `k` and `v` of shape [layers, heads, n, head_dim] (both Torch
decoders lay a sequence's cache out that way); a path from the root spells a stored prefix. So
what prompts share (a system prompt, a conversation's history) is held once, and storing a
prompt copies only what the tree lacks: the next turn of a chat adds its question and answer,
clients sharing a system prompt add their own questions. (SGLang's RadixAttention keeps its KV
this way.) Matching is on ids, longest common prefix, and may end inside a node: its first ids
are reused ("trim, don't discard").
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backends.contract import PromptCacheUsage
from backends.torch.kv_pages import PAGE, pages_for


@dataclass(eq=False)
class Node:
    ids: tuple[int, ...]
    k: Any  # torch.Tensor [layers, heads, len(ids), head_dim]; None at the root
    v: Any
    nbytes: int
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)  # by first id
    used: int = 0  # when it was last matched or stored (a counter, not a clock)
    # A paged cache's node (`PagedPrefixCache`): its first id's position, and the pool's pages
    # that hold its positions (the first and last may hold its neighbours' too).
    start: int = 0
    pages: list[int] | None = None


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]: halve the gap
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.limit_bytes = budget_bytes  # what it keeps to (a paged cache: whole pages, maybe less)
        self.bytes = 0
        self.roots: dict[str, Node] = {}  # one tree a namespace (an adapter's KV is its own)
        self._clock = itertools.count(1)
        # Eviction candidates, oldest first: (used, order, node) for every node that became a leaf
        # or was used while one. An entry goes stale when its node is used again, gets children
        # or leaves the tree; stale entries are skipped when popped, and the heap is rebuilt from
        # the tree once they are most of it; a walk of the tree for its leaves at every store
        # stalled every stream when many sequences ended together (docs/decisions.md, D-evict-heap).
        self._candidates: list[tuple[int, int, Node]] = []
        self._order = itertools.count()
        self._rebuild_at = 64

    def usage(self) -> PromptCacheUsage:
        return PromptCacheUsage(self.budget_bytes, self.bytes, sum(1 for _ in self._leaves()))

    def match(self, ids: list[int], limit: int, namespace: str = "") -> tuple[int, list[tuple[Node, int]]]:
        """The longest prefix of `ids` (at most `limit` ids) held in `namespace`: its length, and
        the nodes that hold it with how many of each node's ids it takes, in order."""
        _, path, matched, _ = self._touch(tuple(ids[:limit]), namespace)
        return matched, path

    def store(
        self, ids: list[int], bytes_per_id: int, kv: Callable[[int, int], tuple[Any, Any]], namespace: str = ""
    ) -> None:
        """Hold the KV of `ids`; `kv(start, end)` copies out of the decoder the KV of
        ids[start:end], for what the tree does not hold yet.

        Least recently used leaves leave until the new ids fit (never the path they extend); ids
        that would not fit even then are not stored. The budget is never exceeded.
        """
        key = tuple(ids)
        if not key or self.budget_bytes <= 0:
            return
        root, path, matched, now = self._touch(key, namespace)
        if matched == len(key):
            return
        nbytes = (len(key) - matched) * bytes_per_id
        last, taken = path[-1] if path else (root, 0)
        split_bytes = (len(last.ids) - taken) * bytes_per_id  # a split copies the rest of that node
        if not self._make_room(nbytes + split_bytes, keep=last):
            return
        parent = self._split(last, taken, bytes_per_id) if path else root
        k, v = kv(matched, len(key))
        leaf = Node(key[matched:], k, v, nbytes, parent, used=now)
        parent.children[leaf.ids[0]] = leaf
        self.bytes += nbytes
        self._candidate(leaf)

    def clear(self) -> None:
        self.roots.clear()
        self.bytes = 0
        self._candidates = []

    # -- the tree ----------------------------------------------------------------------------

    def _root(self, namespace: str) -> Node:
        if namespace not in self.roots:
            self.roots[namespace] = Node((), None, None, 0, None)
        return self.roots[namespace]

    def _touch(self, key: tuple[int, ...], namespace: str) -> tuple[Node, list[tuple[Node, int]], int, int]:
        """The namespace's root, the path that holds the longest prefix of `key` and its length,
        and now: the path's nodes are marked used now."""
        root = self._root(namespace)
        path, matched = self._walk(key, root)
        now = next(self._clock)
        for node, _ in path:
            node.used = now
        if path and not path[-1][0].children:
            self._candidate(path[-1][0])
        return root, path, matched, now

    def _walk(self, key: tuple[int, ...], root: Node) -> tuple[list[tuple[Node, int]], int]:
        path, matched, node = [], 0, root
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            n = common_prefix(child.ids, key[matched:])
            path.append((child, n))
            matched += n
            if n < len(child.ids):
                break
            node = child
        return path, matched

    def _split(self, node: Node, keep: int, bytes_per_id: int) -> Node:
        """Make `node` end after its first `keep` ids (a new child takes the rest); returns it.

        The rest is copied; the node keeps a view of its first ids and is still charged for its
        whole memory, which the view keeps alive: the budget counts what is really held, and
        the (usually long) shared part is not copied."""
        if keep == len(node.ids):
            return node
        rest_bytes = (len(node.ids) - keep) * bytes_per_id
        rest = Node(
            node.ids[keep:],
            node.k[:, :, keep:].clone(),
            node.v[:, :, keep:].clone(),
            rest_bytes,
            node,
            node.children,
            node.used,
        )
        for child in rest.children.values():
            child.parent = rest
        node.ids, node.k, node.v = node.ids[:keep], node.k[:, :, :keep], node.v[:, :, :keep]
        node.children = {rest.ids[0]: rest}
        self.bytes += rest_bytes
        if not rest.children:
            self._candidate(rest)
        return node

    def _nodes(self):
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _leaves(self):
        return (node for node in self._nodes() if not node.children)

    def _make_room(self, nbytes: int, keep: Node) -> bool:
        """Evict least recently used leaves, never `keep` or its ancestors, until `nbytes` fit."""
        if nbytes > self.limit_bytes:
            return False
        if self.bytes + nbytes <= self.limit_bytes:
            return True
        protected = set()
        node = keep
        while node is not None:
            protected.add(id(node))
            node = node.parent
        spared = []  # protected leaves: candidates again after this store
        try:
            while self.bytes + nbytes > self.limit_bytes:
                oldest = self._oldest_leaf()
                if oldest is None:
                    return False
                if id(oldest) in protected:
                    spared.append(oldest)
                    continue
                parent = oldest.parent
                del parent.children[oldest.ids[0]]
                self.bytes -= oldest.nbytes
                self._forget(oldest)
                if not parent.children and parent.parent is not None:  # a leaf in its turn
                    self._candidate(parent)
            return True
        finally:
            for leaf in spared:
                self._candidate(leaf)

    def _candidate(self, node: Node) -> None:
        heapq.heappush(self._candidates, (node.used, next(self._order), node))
        # Rebuilt here, not where evictions happen: a cache that never fills still pushes an
        # entry at every match of a leaf, and would keep them all.
        if len(self._candidates) > self._rebuild_at:
            self._rebuild_candidates()

    def _oldest_leaf(self) -> Node | None:
        """The least recently used leaf in the tree (taken off the candidates), or None."""
        while self._candidates:
            used, _, node = heapq.heappop(self._candidates)
            parent = node.parent
            in_tree = parent is not None and parent.children.get(node.ids[0]) is node
            if in_tree and not node.children and node.used == used:
                return node
        return None

    def _rebuild_candidates(self) -> None:
        self._candidates = [(leaf.used, next(self._order), leaf) for leaf in self._leaves()]
        heapq.heapify(self._candidates)
        self._rebuild_at = max(64, 4 * len(self._candidates))

    def _forget(self, node: Node) -> None:
        """A node left the tree: its tensors go (a stale eviction candidate may still name it)."""
        node.k = node.v = None


class PagedPrefixCache(PrefixCache):
    """The paged decoder's prompt cache (backends/kv_pages): its nodes hold the pool's pages, so
    storing a prompt copies nothing (it keeps the pages of the row that computed it) and a hit
    copies nothing either (the new row's table points at them; `pages_of`). Splitting a node
    splits its page list. Its budget counts each node's pages, so a page that two nodes share
    (one ends in it, the next begins) counts twice: what the cache holds never exceeds it.
    """

    def __init__(self, budget_bytes: int, kv, pages: int):
        """`pages`: the most pages it may keep (the pool's room for it, within the budget)."""
        super().__init__(budget_bytes)
        self.kv = kv  # a kv_pages.PagedKV
        self.limit_bytes = min(budget_bytes, pages * kv.page_bytes)

    def store_pages(self, ids: list[int], pages: list[int], namespace: str = "") -> None:
        """Hold the KV of `ids`, which `pages` (a row's, from position 0) hold."""
        key = tuple(ids)
        if not key or self.budget_bytes <= 0:
            return
        root, path, matched, now = self._touch(key, namespace)
        if matched == len(key):
            return
        first, last = matched // PAGE, (len(key) - 1) // PAGE
        nbytes = (last - first + 1) * self.kv.page_bytes
        tail, taken = path[-1] if path else (root, 0)
        split_bytes = self.kv.page_bytes if path and taken < len(tail.ids) else 0  # a split may share a page
        if not self._make_room(nbytes + split_bytes, keep=tail):
            return
        parent = self._split_pages(tail, taken) if path else root
        leaf = Node(key[matched:], None, None, nbytes, parent, used=now, start=matched)
        leaf.pages = self.kv.keep(pages[first : last + 1])
        parent.children[leaf.ids[0]] = leaf
        self.bytes += nbytes
        self._candidate(leaf)

    def store_row(self, ids: list[int], pages: list[int], namespace: str, disk=None) -> None:
        """`store_pages`, and `disk` (PROMPT_CACHE_DIR's backends/torch/prompt_disk.PromptDisk; None
        or False: no file) writes them behind: what the files lack is copied out of the pool now."""
        self.store_pages(ids, pages, namespace=namespace)
        if disk:
            disk.write_behind(namespace, ids, lambda start, end: self.kv.read_columns(pages, start, end))

    def pages_of(self, path: list[tuple[Node, int]], matched: int) -> list[int]:
        """The pages that hold positions 0..matched-1 of a match (`match`'s path), page by page:
        where a page holds the end of one node and the start of the next, the deeper node's
        (its copy holds both; the other's holds another continuation past the shared end)."""
        pages = [0] * pages_for(matched)
        for node, n in path:
            first = node.start // PAGE
            for index in range(first, (node.start + n - 1) // PAGE + 1):
                pages[index] = node.pages[index - first]
        return pages

    def clear(self) -> None:
        for node in list(self._nodes()):
            self._forget(node)
        super().clear()

    def _split_pages(self, node: Node, keep: int) -> Node:
        """Make `node` end after its first `keep` ids (a new child takes the rest, and the pages
        that hold it); returns it."""
        if keep == len(node.ids):
            return node
        first, cut = node.start // PAGE, node.start + keep
        head = node.pages[: (cut - 1) // PAGE - first + 1]
        tail = node.pages[cut // PAGE - first :]
        rest = Node(node.ids[keep:], None, None, len(tail) * self.kv.page_bytes, node, node.children, node.used)
        rest.start, rest.pages = cut, self.kv.keep(tail)
        for child in rest.children.values():
            child.parent = rest
        old = node.pages
        node.pages = self.kv.keep(head)
        self.kv.drop(old)
        head_bytes = len(head) * self.kv.page_bytes
        self.bytes += rest.nbytes + head_bytes - node.nbytes
        node.ids, node.nbytes, node.children = node.ids[:keep], head_bytes, {rest.ids[0]: rest}
        if not rest.children:
            self._candidate(rest)
        return node

    def _forget(self, node: Node) -> None:
        if node.pages is not None:
            self.kv.drop(node.pages)
            node.pages = None
