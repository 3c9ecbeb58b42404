"""Per-request LoRA adapters on MLX: each sequence's adapter is applied, unmerged, to its own rows
of a batch that other adapters and the base model share.

mlx-lm's BatchGenerator reorders, pads, splits and filters the rows of its batch as sequences
join and leave, and tells the model nothing about which row is whose. So the adapter travels
with the tokens themselves: a sequence using adapter slot s feeds the model its ids offset by
(s + 1) * V (V: the embedding's rows), base sequences their plain ids. The model's embedding is
wrapped in a `RoutedEmbedding` that reads each token's slot off its id (for every LoRA layer of
that forward pass, through the shared `Router`) and embeds the plain id; a sequence's sampler
returns its choice offset the same way (`routed_sampler`), so the next step's input is routed
too, and the decoders report ids modulo V.

The Linear layers an adapter adapts become `SlotLoRALinear`s (on first use), which add
scale * (x @ lora_a) @ lora_b for the rows of each slot: every slot's low-rank factors side by
side, columns masked by the row's slot. The factors live outside the model, which every
decoder of a backend shares, in each decoder's own `SlotBank`: a decoder makes its bank the
router's while it builds a forward pass (MLX records the arrays then, so a later change of a
bank does not reach that pass).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from backends.files.adapters import Adapter, SlotTable, block_index
from backends.mlx.sampling import SequenceSampler


class Router:
    """What the layers of one forward pass share: whose slot weights it uses, and each token's slot."""

    def __init__(self, vocab: int, dtype: mx.Dtype):
        self.vocab = vocab  # V: the model's vocabulary, the embedding's rows
        self.dtype = dtype  # the model's compute dtype, which the slot weights are cast to
        self.bank: SlotBank | None = None  # the bank of the decoder building a forward pass
        self.slots: mx.array | None = None  # [B, L] of that pass: each token's slot, -1 for the base model

    @contextlib.contextmanager
    def using(self, bank: SlotBank) -> Iterator[None]:
        """Forward passes built inside this block apply `bank`'s adapters."""
        previous, self.bank = self.bank, bank
        try:
            yield
        finally:
            self.bank = previous

    def offset(self, slot: int | None) -> int:
        """What a sequence in `slot` (None: the base model) adds to its token ids."""
        return 0 if slot is None else (slot + 1) * self.vocab

    def plain(self, ids: list[int]) -> list[int]:
        return [i % self.vocab for i in ids]


class RoutedEmbedding(nn.Module):
    """The model's token embedding over routed ids: it embeds id % V and tells the LoRA layers
    of this pass each token's slot (only while some sequence of the bank uses an adapter)."""

    def __init__(self, inner: nn.Module, router: Router):
        super().__init__()
        self.inner = inner
        self._router = router

    def __call__(self, ids: mx.array) -> mx.array:
        router = self._router
        bank = router.bank
        # int32 first: sampled ids are uint32, whose base rows would wrap around below zero
        router.slots = ids.astype(mx.int32) // router.vocab - 1 if bank is not None and bank.active else None
        return self.inner(ids % router.vocab)

    def as_linear(self, x: mx.array) -> mx.array:  # models with tied heads read the embedding back
        return self.inner.as_linear(x)


class SlotLoRALinear(nn.Module):
    """A Linear (or QuantizedLinear) plus, for each row, the LoRA update of its slot's adapter."""

    def __init__(self, base: nn.Module, name: str, router: Router):
        super().__init__()
        self.base = base
        self._name = name
        self._router = router

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        bank = self._router.bank
        if bank is None or not bank.active:  # a base-only batch pays for nothing more
            return y
        factors = bank.factors.get(self._name)
        if factors is None:  # no adapter in the bank adapts this layer
            return y
        a, b, cols = factors
        mine = (cols == self._router.slots[..., None]).astype(a.dtype)  # [B, L, R]: the columns of each row's slot
        return y + (((x @ a) * mine) @ b).astype(y.dtype)


class SlotBank:
    """One decoder's adapter slots: which adapter each holds (a SlotTable), and for every Linear
    that any of them adapts the slots' factors side by side: A [in, R], B [R, out] (scale folded
    in) and cols [R], the slot of each of the R columns."""

    def __init__(self, model: nn.Module, router: Router, size: int):
        self.table = SlotTable(size)
        self.factors: dict[str, tuple[mx.array, mx.array, mx.array]] = {}
        # Whether a running sequence uses an adapter: read by every LoRA layer of every pass, so a
        # plain flag kept up to date here rather than asked of the table.
        self.active = False
        self._model = model
        self._router = router
        self._held: list[Adapter | None] = [None] * size

    def acquire(self, adapter: Adapter | None) -> int | None:
        """The slot a sequence using `adapter` decodes in (None for the base model), with the
        adapter's factors in place; release it when the sequence ends."""
        if adapter is None:
            return None
        slot, fresh = self.table.acquire(adapter.key)
        if fresh:
            previous = self._held[slot]
            try:
                self._place(slot, adapter)
            except BaseException:  # the slot keeps what it held, as if never acquired
                self.table.release(slot)
                self.table.keys[slot] = previous.key if previous is not None else None
                raise
        self.active = True
        return slot

    def release(self, slot: int | None) -> None:
        if slot is None:
            return
        self.table.release(slot)
        self.active = self.table.active()

    def _place(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` in `slot`, in place of what it held; all or nothing."""
        held = list(self._held)
        previous, held[slot] = held[slot], adapter
        changed = set(adapter.modules) | (set(previous.modules) if previous is not None else set())
        gathered = {name: _side_by_side(held, name, self._router.dtype) for name in changed}
        mx.eval([factors for factors in gathered.values() if factors is not None])  # once here, not in a step
        install_slot_layers(self._model, self._router, adapter.modules)
        self._held = held
        for name, factors in gathered.items():
            if factors is None:
                self.factors.pop(name, None)
            else:
                self.factors[name] = factors


def _side_by_side(held: list[Adapter | None], name: str, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array] | None:
    """The factors of layer `name` of every slot's adapter that adapts it: (A, B, cols), or None."""
    users = [(slot, adapter) for slot, adapter in enumerate(held) if adapter is not None and name in adapter.modules]
    if not users:
        return None
    a = mx.concatenate([adapter.modules[name][0].astype(dtype) for _, adapter in users], axis=1)
    b = mx.concatenate([(adapter.modules[name][1] * adapter.scale).astype(dtype) for _, adapter in users], axis=0)
    cols = mx.concatenate(
        [mx.full((adapter.modules[name][0].shape[1],), slot, dtype=mx.int32) for slot, adapter in users]
    )
    return a, b, cols


def install_router(model: nn.Module) -> Router:
    """Wrap the model's token embedding in a RoutedEmbedding; the router its LoRA layers will share."""
    inner_model = model.model
    embedding = inner_model.embed_tokens
    if isinstance(embedding, RoutedEmbedding):
        return embedding._router
    scales = getattr(embedding, "scales", None)  # a QuantizedEmbedding's weight is packed integers
    dtype = (scales if scales is not None else embedding.weight).dtype
    router = Router(int(embedding.weight.shape[0]), dtype)
    inner_model.embed_tokens = RoutedEmbedding(embedding, router)
    return router


def install_slot_layers(model: nn.Module, router: Router, names) -> None:
    """Make each named Linear a SlotLoRALinear (those that are one already stay as they are)."""
    for name in names:
        parent_path, _, leaf = name.rpartition(".")
        parent = _submodule(model, parent_path)
        layer = getattr(parent, leaf)
        if not isinstance(layer, SlotLoRALinear):
            setattr(parent, leaf, SlotLoRALinear(layer, name, router))


def _submodule(model: nn.Module, path: str):
    module = model
    for part in path.split("."):
        module = module[int(part)] if isinstance(module, list) else getattr(module, part)
    return module


def block_linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) of each Linear inside the model's blocks, by module name (what adapters must fit)."""
    shapes = {}
    for name, module in model.named_modules():
        if block_index(name) is None:
            continue
        if isinstance(module, nn.QuantizedLinear):  # its weight packs 32 / bits inputs in each uint32
            out_dims, packed = module.weight.shape
            shapes[name] = (packed * 32 // module.bits, out_dims)
        elif isinstance(module, nn.Linear):
            out_dims, in_dims = module.weight.shape
            shapes[name] = (in_dims, out_dims)
    return shapes


def load_adapter_tensors(path: Path) -> dict[str, mx.array]:
    """An adapter's weights, read now: mx.load is lazy, and a lazy array can only be evaluated
    on the thread that made it (handlers load adapters on a pool, the generation thread uses them)."""
    tensors = mx.load(str(path))
    mx.eval(tensors)
    return tensors


class OffsetSampler:
    """A sampler whose choices are routed: the inner sampler chooses among plain ids (its
    penalties and grammar see those), then the slot's offset is added."""

    def __init__(self, inner: Callable[[mx.array], mx.array], offset: int):
        self.inner = inner
        self.offset = offset

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.inner(logprobs) + self.offset


@functools.cache
def _shared_offset_sampler(inner: Callable[[mx.array], mx.array], offset: int) -> OffsetSampler:
    return OffsetSampler(inner, offset)


def routed_sampler(inner: Callable[[mx.array], mx.array], offset: int) -> Callable[[mx.array], mx.array]:
    """`inner` for a sequence whose ids carry `offset`. A shared (plain greedy) sampler stays
    shared per offset: BatchGenerator samples rows sharing one sampler object in one call."""
    if offset == 0:
        return inner
    if isinstance(inner, SequenceSampler):  # one sequence's own: caching it would keep it alive
        return OffsetSampler(inner, offset)
    return _shared_offset_sampler(inner, offset)
