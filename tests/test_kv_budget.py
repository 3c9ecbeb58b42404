"""The KV budget of the Torch CPU decoder (KV_CACHE_BYTES): the cache's pool holds only the pages
its sequences use, a sequence joins only if its prompt and max_tokens fit beside the others',
and the served context is what one sequence fits. On the tiny model (float32, context
512) one position's KV takes `bytes_per_token` bytes."""

from __future__ import annotations

import asyncio
import random
import sys

import pytest

from backends.choose import load_backend
from backends.contract import LoadOptions, ModelLoadError, Sampling, Sequence
from backends.decoding.drive import drive
from backends.torch.decoder import BatchedDecoder
from backends.torch.tiny import CONTEXT_LENGTH
from tests.conftest import engine_of, wait_idle

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def full_context_bytes(decoder: BatchedDecoder, sequences: float) -> int:
    """A budget that holds this many sequences at the full context."""
    return int(sequences * (CONTEXT_LENGTH + 1) * decoder.per_position)


def long_sequences(vocab: int, count: int, prompt: int = 300, new: int = 200) -> list[Sequence]:
    draw = random.Random(7)
    return [Sequence(i, [draw.randrange(vocab) for _ in range(prompt)], Sampling(), new) for i in range(count)]


def within(usage) -> bool:
    return usage.peak_bytes <= usage.budget_bytes


def test_long_sequences_that_do_not_fit_together_take_turns_and_decode_as_alone(torch_backend):
    weights = torch_backend.decoder_weights
    probe = BatchedDecoder(weights, 1)
    budget = full_context_bytes(probe, 1.5)  # one at a time: 300 + 200 positions each
    decoder = BatchedDecoder(weights, 4, kv_cache_bytes=budget)
    sequences = long_sequences(torch_backend.vocab_size, 3)
    together = []
    got = drive(decoder, sequences, on_tokens=lambda step, tokens: together.append(len(decoder.slots)))
    for sequence in sequences:
        assert got.ids[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id]
    assert max(together) == 1
    usage = decoder.kv_cache_usage()
    assert usage.budget_bytes == budget and within(usage)
    assert usage.reserved_bytes == 0 and usage.used_bytes < usage.peak_bytes  # given back once they ended


def test_short_sequences_share_the_budget_that_a_long_one_takes_alone(torch_backend):
    weights = torch_backend.decoder_weights
    budget = full_context_bytes(BatchedDecoder(weights, 1), 1.5)
    decoder = BatchedDecoder(weights, 4, kv_cache_bytes=budget)
    short = [Sequence(i, torch_backend.encode("Once upon a time"), Sampling(), 40) for i in range(4)]
    together = []
    drive(decoder, short, on_tokens=lambda step, tokens: together.append(len(decoder.slots)))
    assert max(together) == 4
    for sequence in short:
        decoder.add(sequence)
    assert not decoder.fits([10])  # MAX_BATCH
    decoder.remove(0)
    assert decoder.fits([60])
    # Rows hold pages for what they need (backends/kv_pages): beside three short rows a
    # full-context one fits (with full-context rows they were four, past 1.5)...
    assert decoder.fits([CONTEXT_LENGTH])
    decoder.remove(1)
    assert decoder.fits([CONTEXT_LENGTH, 60])
    # ...and two do not.
    assert not decoder.fits([CONTEXT_LENGTH, CONTEXT_LENGTH])
    usage = decoder.kv_cache_usage()
    assert usage.used_bytes == usage.blocks_used * usage.block_tokens * usage.bytes_per_token > 0


def test_a_cache_allocated_whole_reports_itself_as_the_budget(torch_backend):
    # As on CUDA, where graphs hold the cache's addresses (its context was cut to fit KV_CACHE_BYTES).
    decoder = BatchedDecoder(torch_backend.decoder_weights, 2, cuda_graphs=True)
    usage = decoder.kv_cache_usage()
    # With no KV_CACHE_BYTES, a full-context row's pages for each row, and the scratch page.
    pages = 2 * -(-(CONTEXT_LENGTH + 1) // usage.block_tokens)
    assert usage.blocks == pages and usage.blocks_used == usage.used_bytes == 0
    assert usage.budget_bytes == usage.allocated_bytes == (pages + 1) * usage.block_tokens * usage.bytes_per_token
    sized = BatchedDecoder(torch_backend.decoder_weights, 2, cuda_graphs=True, kv_cache_bytes=usage.budget_bytes // 3)
    assert sized.kv_cache_usage().allocated_bytes <= usage.budget_bytes // 3  # KV_CACHE_BYTES: the pool, whole
    assert sized.fits([100, 100]) and not sized.fits([CONTEXT_LENGTH])


@pytest.fixture(scope="module")
def budget_backend(tiny_path):
    """The tiny model loaded with a KV budget of 1.5 full-context sequences."""
    probe = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", warmup=False))
    budget = full_context_bytes(BatchedDecoder(probe.decoder_weights, 1), 1.5)
    return load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", kv_cache_bytes=budget))


async def test_a_server_within_its_budget_serves_every_full_context_request(make_client, budget_backend):
    # A prompt cache as large as the KV budget (one full-context prompt fits), whose pages the pool
    # holds besides the rows.
    client = await make_client(lambda: budget_backend, max_batch=4, prompt_cache_bytes=budget_backend.kv_budget)
    info = await (await client.get("/model/info")).json()
    assert info["context_length"] == CONTEXT_LENGTH  # one sequence at the full context fits
    prompts = [s.prompt_ids for s in long_sequences(budget_backend.vocab_size, 4, prompt=CONTEXT_LENGTH - 100)]

    async def complete(prompt):
        body = {"prompt": prompt, "max_tokens": 100, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        return response.status, await response.json()

    answers = await asyncio.gather(*(complete(p) for p in prompts))
    for status, body in answers:
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 100
    await wait_idle(engine_of(client))
    kv = (await (await client.get("/model/info")).json())["kv_cache"]
    assert kv["budget_bytes"] == budget_backend.kv_budget
    assert kv["peak_bytes"] >= (CONTEXT_LENGTH - 1) * kv["bytes_per_token"]  # one reached the full context
    # The pool holds the prompt cache's pages too (a hit shares them): within both budgets.
    prompt_cache = (await (await client.get("/model/info")).json())["prompt_cache"]
    assert 0 < prompt_cache["bytes"] <= prompt_cache["budget_bytes"] == budget_backend.kv_budget
    assert kv["peak_bytes"] <= kv["budget_bytes"] + prompt_cache["budget_bytes"]
    assert kv["reserved_bytes"] == 0
    text = await (await client.get("/metrics")).text()
    metrics = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("phi2_kv")}
    assert metrics["phi2_kv_cache_budget_bytes"] == kv["budget_bytes"]
    assert metrics["phi2_kv_cache_peak_bytes"] == kv["peak_bytes"]


def test_a_budget_smaller_than_the_context_cuts_the_window(tiny_path, caplog):
    probe = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", warmup=False))
    per_position = BatchedDecoder(probe.decoder_weights, 1).per_position
    backend = load_backend(
        "torch", LoadOptions(model=str(tiny_path), dtype="float32", kv_cache_bytes=300 * per_position, warmup=False)
    )
    assert len(backend.decoder_weights.layers) == 2
    # Pages of 16 positions: 300 / 16 = 18 pages, less the scratch page: 272 positions.
    assert backend.info.context_length == 272
    assert "context window cut from 512 to 272" in caplog.text
    with pytest.raises(ModelLoadError, match="KV_CACHE_BYTES"):
        load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", kv_cache_bytes=per_position))


async def test_a_request_past_the_cut_window_is_refused(make_client, tiny_path):
    probe = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", warmup=False))
    per_position = BatchedDecoder(probe.decoder_weights, 1).per_position
    backend = load_backend(
        "torch", LoadOptions(model=str(tiny_path), dtype="float32", kv_cache_bytes=300 * per_position)
    )
    client = await make_client(lambda: backend, max_batch=4)
    response = await client.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 4})
    assert response.status == 400
    assert "272" in (await response.json())["error"]["message"]


async def test_the_default_budget_comes_from_the_available_memory(client, backend):
    kv = (await (await client.get("/model/info")).json())["kv_cache"]
    if backend.info.backend == "mlx":
        assert kv["budget_bytes"] == 0 and kv["used_bytes"] is None  # mlx-lm's cache is not counted
    else:
        assert kv["budget_bytes"] == backend.kv_budget > 0
        assert kv["bytes_per_token"] > 0


def small_pool(layers: int, kv_heads: int, head_dim: int, context: int, most: int = 64):
    """A float32 CPU pool of 12 pages (the scratch page included) for 3 rows, which may grow to
    `most_pages`."""
    import torch

    from backends.torch.kv_pages import PagedKV

    cpu = torch.device("cpu")
    return PagedKV(layers, kv_heads, head_dim, torch.float32, cpu, rows=3, context=context, pages=12, most_pages=most)


def test_the_pool_shrinks_under_held_pages_and_keeps_their_contents():
    """backends/kv_pages: pages held past a smaller pool's end move below it, with their keys and
    values and their table entries; pages freed go back to be taken again."""
    import torch

    from backends.torch.kv_pages import PAGE

    kv = small_pool(layers=2, kv_heads=2, head_dim=4, context=10 * PAGE)
    kv.assign(0, 5 * PAGE)
    kv.assign(1, 3 * PAGE)
    kv.assign(2, 2 * PAGE)  # the last pages taken: ids 9 and 10
    columns = torch.arange(2 * PAGE)
    for layer in range(2):
        keys = torch.randn(2 * PAGE, 2, 4)
        kv.write(layer, torch.tensor(2), columns, keys, -keys)
    before = kv.columns_of(kv.held[2], 0, 2 * PAGE)
    kv.release([0])  # frees 5 low pages
    kv.resize(7)  # 1 scratch + 3 + 2 held: row 2's pages move down
    assert kv.pages == 7 and max(max(held) for held in kv.held if held) < 7
    assert kv.held_pages == 5 and len(kv.free) == 1  # and the scratch page
    after = kv.columns_of(kv.held[2], 0, 2 * PAGE)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert kv.table[2, :2].tolist() == kv.held[2] and kv.table[0].tolist() == [0] * kv.width
    kv.release([1, 2])
    assert kv.held_pages == 0 and sorted(kv.free) == list(range(1, 7))


def test_each_layer_of_a_growing_pool_is_contiguous():
    """The CPU's index_select and index_put copy a non-contiguous tensor whole before indexing it:
    a layer's keys and values seen as only the pool's extent (not contiguous) cost a layer's copy
    at every gather and write (185 ms in two steps of Phi-2's 2,032-token prompt beside 4 short
    rows)."""
    kv = small_pool(layers=2, kv_heads=3, head_dim=4, context=10 * 16, most=40)
    for pages in (12, 30, 5):
        kv.resize(pages)
        assert all(cache[layer].is_contiguous() for cache in (kv.k, kv.v) for layer in range(2))


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    import mmap

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def zeros(kv, first: int, end: int) -> bool:
    """Pages first..end-1 hold zeros in every layer (read in place: no copy to count)."""
    return not any(cache[layer][:, first:end].any() for cache in (kv.k, kv.v) for layer in range(kv.layers))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory from /proc, MADV_DONTNEED's zeros")
def test_a_pool_takes_memory_where_rows_write_grows_without_a_copy_and_gives_memory_back():
    """backends/kv_pages on the CPU: the pool's most pages are address space, not memory; a row's
    pages are zeros when it first takes them, the pool's extent grows without moving what rows
    hold, and a shrink gives the memory past its end back (those pages read as zeros again)."""
    import torch

    from backends.torch.kv_pages import PAGE

    mib = 1 << 20
    before = resident_bytes()
    # One head's page is 16 x 64 float32 = 4 KB, a system page; 4 layers x 4 heads x k and v =
    # 32 stripes of 2,048 pages: 256 MiB of address space.
    kv = small_pool(layers=4, kv_heads=4, head_dim=64, context=1024 * PAGE, most=2048)
    assert kv.nbytes == 12 * kv.page_bytes and resident_bytes() - before < 16 * mib
    kv.assign(0, 3 * PAGE)
    rows = torch.arange(3 * PAGE)
    for layer in range(4):
        keys = torch.randn(3 * PAGE, 4, 64)
        kv.write(layer, torch.tensor(0), rows, keys, -keys)
    held = kv.columns_of(kv.held[0], 0, 3 * PAGE)
    before = resident_bytes()  # torch's first operations take memory of their own
    storage = kv.k[0].untyped_storage().data_ptr()
    kv.resize(1 + 3 + 1000)  # the extent grows past the 12 pages: nothing moves
    kv.assign(1, 1000 * PAGE)
    assert kv.pages == 1 + 3 + 1000 and kv.k[0].untyped_storage().data_ptr() == storage
    assert all(torch.equal(a, b) for a, b in zip(held, kv.columns_of(kv.held[0], 0, 3 * PAGE), strict=True))
    assert sorted(kv.held[1]) == list(range(4, 1004)) and zeros(kv, 4, 1004)
    assert resident_bytes() - before < 16 * mib  # read, not written: still not memory
    written = resident_bytes()
    ones = torch.ones(1000 * PAGE, 4, 64)
    for layer in range(4):
        kv.write(layer, torch.tensor(1), torch.arange(1000 * PAGE), ones, ones)
    assert resident_bytes() - written > 100 * mib  # 1,000 pages x 32 stripes x 4 KB = 125 MiB
    kv.release([1])
    full = resident_bytes()
    kv.resize(8)  # 1 scratch + row 0's 3, room to spare
    assert kv.pages == 8 and full - resident_bytes() > 100 * mib
    assert all(torch.equal(a, b) for a, b in zip(held, kv.columns_of(kv.held[0], 0, 3 * PAGE), strict=True))
    kv.resize(1 + 3 + 500)
    kv.assign(2, 500 * PAGE)  # pages 4..7 keep what row 1 wrote; those past 8 were given back: zeros
    assert sorted(kv.held[2]) == list(range(4, 504)) and zeros(kv, 8, 504) and not zeros(kv, 4, 8)


def test_a_page_that_rows_and_the_cache_share_returns_to_the_pool_once_none_holds_it():
    """backends/kv_pages: a page kept by the prompt cache (`keep`) and taken by rows (`assign`'s
    `shared`) is counted once; a shrink moves a shared page once, and renumbers the cache's
    lists and the rows' tables alike."""
    import torch

    from backends.torch.kv_pages import PAGE

    kv = small_pool(layers=1, kv_heads=1, head_dim=2, context=8 * PAGE)
    kv.assign(0, 4 * PAGE)  # takes low pages first
    kv.assign(1, 5 * PAGE)  # pages 5..9
    columns = torch.arange(3 * PAGE)
    kv.write(0, torch.tensor(1), columns, torch.randn(3 * PAGE, 1, 2), torch.randn(3 * PAGE, 1, 2))
    before = kv.columns_of(kv.held[1], 0, 3 * PAGE)
    kept = kv.keep(kv.held[1][:3])  # row 1's prompt, stored
    kv.assign(2, 4 * PAGE, shared=kv.held[1][:2])  # a later prompt shares two of its pages
    assert kv.row_pages == 4 + 5 + 2 and kv.held_pages == 4 + 5 + 2
    kv.release([0, 1])
    assert kv.row_pages == 4 and kv.held_pages == 5  # row 2's 4, and the one only the cache keeps
    kv.resize(6)  # 1 scratch + 5 held: the shared pages move below 6, once each
    assert max(kept) < 6 and kv.held[2][:2] == kept[:2] and len(set(kv.held[2])) == 4
    assert kv.table[2, :4].tolist() == kv.held[2]
    assert all(torch.equal(a, b) for a, b in zip(before, kv.columns_of(kept, 0, 3 * PAGE), strict=True))
    kv.release([2])
    assert kv.row_pages == 0 and kv.held_pages == 3
    kv.drop(kept)
    assert kv.held_pages == 0 and sorted(kv.free) == list(range(1, 6))


def test_a_pool_allocated_whole_has_room_for_the_prompt_cache_it_is_made_with(torch_backend, monkeypatch):
    """On CUDA the pool is allocated once: the runtime makes the decoder with the prompt cache's
    budget (a pool made without room for it served no prompt from the cache), and a later budget
    cannot exceed that room."""
    from backends.torch import decoder as torch_decoder
    from backends.torch.kv_pages import PAGE

    made = []

    class Recorded(torch_decoder.BatchedDecoder):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("prompt_cache_bytes", 0))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch_decoder, "BatchedDecoder", Recorded)
    monkeypatch.setattr(torch_backend, "_fast_decoder", None)
    torch_backend.decoder(3, prompt_cache_bytes=1 << 22)
    assert made == [1 << 22]
    monkeypatch.undo()
    whole = torch_decoder.BatchedDecoder(torch_backend.decoder_weights, 2, cuda_graphs=True, prompt_cache_bytes=1 << 22)
    whole.clear(prompt_cache_bytes=1 << 30)
    assert whole.prompt_cache_usage().budget_bytes == whole.cache_pages * whole.kv.page_bytes <= 1 << 22
    assert whole.cache_pages > 0 and whole.kv.pages == 1 + 2 * -(-(whole.context + 1) // PAGE) + whole.cache_pages


def test_consecutive_pages_are_read_in_place_on_the_cpu_and_give_what_a_copy_gives():
    """backends/kv_pages `gathered`: a run of consecutive pages (a row alone takes them in order)
    is a view of the pool, not a copy; other pages are copied. Decode attention over rows whose
    pages run on from one row to the next (a view it cannot reshape per row) equals attention
    over copies."""
    from functools import partial

    import torch

    from backends.torch.decoder import Shape, decode_attention
    from backends.torch.kv_pages import PAGE

    kv = small_pool(layers=1, kv_heads=2, head_dim=4, context=10 * PAGE)
    kv.assign(0, 3 * PAGE)  # pages 1, 2, 3
    kv.assign(1, 4 * PAGE)  # pages 4..7: row 0's run goes on
    for row, columns in ((0, 3 * PAGE), (1, 4 * PAGE)):
        keys = torch.randn(columns, 2, 4)
        kv.write(0, torch.tensor(row), torch.arange(columns), keys, keys.flip(0))
    pool = kv.k[0].untyped_storage().data_ptr()
    in_place = kv.gathered(0, kv.table[0, :3])
    assert in_place[0].untyped_storage().data_ptr() == pool
    assert torch.equal(in_place[0], kv.k[0].index_select(1, kv.table[0, :3]))
    copied = kv.gathered(0, torch.tensor([3, 1, 2]))
    assert copied[0].untyped_storage().data_ptr() != pool
    assert torch.equal(copied[0], kv.k[0].index_select(1, torch.tensor([3, 1, 2])))

    shape = Shape(8, heads=4, kv_heads=2, head_dim=4, rotary_dim=4, inner=8, eps=1e-5, rms_norm=False,
                  parallel=True, gated=False, activation=None)  # fmt: skip
    span = 3 * PAGE
    q = torch.randn(2, 4, 4)
    bias = torch.zeros(2 * 2, 1, span)
    table = kv.table[:2]
    assert table[:, :3].flatten().tolist() == [1, 2, 3, 4, 5, 6]  # both rows' first 3 pages: one run

    def copies(pages):
        return kv.k[0].index_select(1, pages), kv.v[0].index_select(1, pages)

    got = decode_attention(q, partial(kv.gathered, 0), table, bias, shape)
    assert torch.allclose(got, decode_attention(q, copies, table, bias, shape))
