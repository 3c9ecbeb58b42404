"""The batched Phi decoder (backends/torch/decoder.py) on the CPU: every sequence in a batch
decodes exactly as it would alone, whoever joins or leaves, however long its prompt."""

from __future__ import annotations

import dataclasses

import pytest

from backends.contract import Sampling, Sequence
from backends.decoding.drive import drive
from backends.torch.cuda.graphs import MIN_LENGTH_BUCKET, Graphs
from backends.torch.decoder import BatchedDecoder, supports
from backends.torch.network import Network
from backends.torch.prefill import InFlight, Prefill

PROMPTS = [
    "The quick brown",
    "Once upon",
    "日本語の",
    "Hello world",
    "def f(x):\n",
    "zq",
    "Alice: How are you today?\nBob:",
]


def alone(backend, prompt: str, n: int, sampling: Sampling = Sampling()) -> list[int]:
    return drive(backend.decoder(1), [Sequence(1, backend.encode(prompt), sampling, n)]).ids[1]


def run_batch(decoder, requests: list[tuple[str, int, Sampling]], backend, cancel: dict[int, int] | None = None):
    """Feed requests in order as slots free up; returns the ids each produced (cancelled ones cut)."""
    sequences = [Sequence(i, backend.encode(prompt), sampling, n) for i, (prompt, n, sampling) in enumerate(requests)]
    return drive(decoder, sequences, stop_after=cancel).ids


def test_the_tiny_model_takes_the_fast_path(torch_backend):
    assert supports(torch_backend.model)
    assert isinstance(torch_backend.decoder(4), BatchedDecoder)


@pytest.mark.parametrize("chunk", [3, 64])
def test_every_sequence_in_a_batch_decodes_as_alone(torch_backend, chunk):
    requests = [(p, n, Sampling()) for p, n in zip(PROMPTS, [40, 7, 90, 1, 33, 60, 25], strict=False)]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 3, prefill_chunk=chunk)
    out = run_batch(decoder, requests, torch_backend)
    for i, (prompt, n, _) in enumerate(requests):
        assert out[i] == alone(torch_backend, prompt, n), prompt


def test_new_prompts_padded_to_a_graphs_shape_decode_as_alone(torch_backend):
    # CUDA's graphed prefill of new prompts (`Graphs.prefill_padded`), run eagerly on the CPU.
    requests = [(p, n, Sampling()) for p, n in zip(PROMPTS, [40, 7, 90, 1, 33, 60, 25], strict=False)]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 4, prefill_graphs=True)
    out = run_batch(decoder, requests, torch_backend)
    assert decoder.network._padded_inputs is not None
    for i, (prompt, n, _) in enumerate(requests):
        assert out[i] == alone(torch_backend, prompt, n), prompt


def test_new_prompts_for_a_prefill_graph_are_neither_cut_nor_grouped_past_a_graph(torch_backend, monkeypatch):
    """With graphed prefill, a new short prompt waits a step rather than be cut by the step's
    token budget (its second piece would be prefilled eagerly), new prompts are not grouped with
    pieces that continue cached columns, and a group larger than a graph takes is split; every
    sequence still decodes as alone."""
    from backends.torch.cuda import graphs as torch_graphs

    monkeypatch.setattr(torch_graphs, "PREFILL_GRAPH_TOKENS", 64)  # a graph takes 4 rows of 16
    pieces, fresh, after = [], [], []
    original_prefill, original_padded = Prefill.run, Graphs.prefill_padded

    def prefill(self, parts, *args, **kwargs):
        pieces.extend((self.rows[i].sequence.id, start) for i, _, start in parts)
        return original_prefill(self, parts, *args, **kwargs)

    def prefill_padded(self, parts, rows, length, span):
        (fresh if not span else after).append(len(parts))
        return original_padded(self, parts, rows, length, span)

    monkeypatch.setattr(Prefill, "run", prefill)
    monkeypatch.setattr(Graphs, "prefill_padded", prefill_padded)
    weights = torch_backend.decoder_weights
    long = torch_backend.encode("A long prompt that the budget cuts into pieces. " * 3)
    short = [torch_backend.encode(f"Short prompt number {i} here") for i in range(9)]
    sequences = [Sequence(0, long, Sampling(), 12)] + [Sequence(i + 1, p, Sampling(), 6) for i, p in enumerate(short)]
    decoder = BatchedDecoder(weights, 10, prefill_graphs=True, prefill_chunk=40)
    assert len(long) > 40 and all(len(p) <= 16 for p in short)
    out = drive(decoder, sequences, arrive_at={i: 1 for i in range(1, 10)}).ids
    assert sorted(i for i, start in pieces if i > 0) == list(range(1, 10))  # each short one in one piece
    assert all(start == 0 for i, start in pieces if i > 0)
    assert sum(fresh) == len(short) + 1  # all graphed, and the long prompt's first piece
    assert sum(after) == sum(1 for i, start in pieces if i == 0 and start)  # its later ones too
    for sequence in sequences:
        assert out[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id]
    # All nine at once, in one step's budget: passes of at most the 4 rows a graph takes.
    fresh.clear()
    together = drive(BatchedDecoder(weights, 10, prefill_graphs=True, prefill_chunk=200), sequences[1:]).ids
    assert sorted(fresh) == [1, 4, 4]
    for sequence in sequences[1:]:
        assert together[sequence.id] == out[sequence.id]


def test_a_prompt_piece_rides_along_in_the_decode_steps_pass(torch_backend, monkeypatch):
    """On the CPU a step's one prompt piece is prefilled in its decode step's own pass
    (`Network.mixed_step`: the weights read once for both), and every sequence still decodes as alone:
    greedy, seeded, with logprobs, its prompt finishing in such a step or not."""
    pieces = []
    original = Network.mixed_step

    def counted(self, batch, span, fused, *rest):
        pieces.extend(len(ids) for _, ids, _ in fused)
        return original(self, batch, span, fused, *rest)

    monkeypatch.setattr(Network, "mixed_step", counted)
    weights = torch_backend.decoder_weights
    long = torch_backend.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 4))
    sequences = [
        Sequence(0, torch_backend.encode("Once upon"), Sampling(), 30),
        Sequence(1, torch_backend.encode("Hello world"), Sampling(temperature=0.9, seed=3), 30, logprobs=2),
        Sequence(2, long, Sampling(), 10),
        Sequence(3, torch_backend.encode("zq"), Sampling(temperature=1.2, seed=8), 10),
    ]
    out = drive(BatchedDecoder(weights, 4, prefill_chunk=8), sequences, arrive_at={2: 2, 3: 3})
    assert len(pieces) >= len(long) // 8 - 1 and max(pieces) == 8
    for sequence in sequences:
        single = drive(BatchedDecoder(weights, 1), [sequence])
        assert out.ids[sequence.id] == single.ids[sequence.id], sequence.id
        if sequence.logprobs is not None:
            assert flat(out.logprobs[sequence.id]) == pytest.approx(flat(single.logprobs[sequence.id]), abs=1e-4)


def test_short_prompts_arriving_behind_a_long_one_share_the_step_budget(torch_backend, monkeypatch):
    """A step's prompt budget goes first to half for the oldest waiting prompt, then to the
    prompts with the fewest tokens left (`Prefill.takes`): short prompts arriving behind a long
    one get their first tokens within a few steps, not after all of its pieces; the long one
    still gets half of every step's budget; a step's several pieces go through one pass, with
    decode rows or none (`Network.mixed_step`); every sequence decodes as alone."""
    passes = []  # each fused pass: (decode rows, its pieces' lengths)
    original = Network.mixed_step

    def counted(self, batch, span, fused, *rest):
        passes.append((batch, [len(ids) for _, ids, _ in fused]))
        return original(self, batch, span, fused, *rest)

    monkeypatch.setattr(Network, "mixed_step", counted)
    weights = torch_backend.decoder_weights
    long = torch_backend.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 14))
    short = ["Once upon", "Hello world", "zq", "def f(x):\n"]
    sequences = [Sequence(0, long, Sampling(), 6)] + [
        Sequence(i + 1, torch_backend.encode(p), Sampling(temperature=0.9, seed=i) if i % 2 else Sampling(), 12)
        for i, p in enumerate(short)
    ]
    sequences[2] = dataclasses.replace(sequences[2], logprobs=2)
    chunk = 16
    assert len(long) > 6 * chunk and all(len(s.prompt_ids) <= chunk // 2 for s in sequences[1:])
    first: dict[int, int] = {}  # each sequence's step of its first token

    def record(step, tokens):
        for seq_id in tokens:
            first.setdefault(seq_id, step)

    out = drive(
        BatchedDecoder(weights, 5, prefill_chunk=chunk), sequences, arrive_at={1: 1, 2: 1, 3: 2, 4: 2}, on_tokens=record
    )
    # The short ones arrive at steps 1-2 and are through within a step or two of it (half the
    # budget beside the long one's half); oldest first, they would have waited for the long
    # prompt's last piece.
    assert all(first[i] <= 3 for i in range(1, 5)), first
    # The long one: its whole budget alone (step 0), at least half of it since.
    assert first[0] <= 1 + -(-(len(long) - chunk) // (chunk // 2)), (first[0], len(long))
    assert any(batch == 0 and len(lengths) > 1 for batch, lengths in passes)  # pieces together, no row decoding
    assert any(batch > 0 and len(lengths) > 1 for batch, lengths in passes)  # pieces together, with rows
    for sequence in sequences:
        single = drive(BatchedDecoder(weights, 1), [sequence])
        assert out.ids[sequence.id] == single.ids[sequence.id], sequence.id
        if sequence.logprobs is not None:
            assert flat(out.logprobs[sequence.id]) == pytest.approx(flat(single.logprobs[sequence.id]), abs=1e-4)


def test_like_prompts_arriving_together_are_prefilled_first_come_first_served(torch_backend):
    """Prompts of one length arriving together go in arrival order, each through its whole
    prompt before the next starts (shared out, all of them would wait for the last piece)."""
    weights = torch_backend.decoder_weights
    prompt = torch_backend.encode("The quick brown fox jumps over the lazy dog. " * 2)
    sequences = [Sequence(i, prompt, Sampling(), 3) for i in range(3)]
    first: dict[int, int] = {}
    drive(
        BatchedDecoder(weights, 3, prefill_chunk=len(prompt) // 2 + 1),
        sequences,
        on_tokens=lambda step, tokens: [first.setdefault(i, step) for i in tokens],
    )
    assert first[0] < first[1] < first[2], first


def flat(steps) -> list:
    """A sequence's logprob events as one list: each token's id, logprob and alternatives."""
    scored = [t for step in steps for t in (*(step.prompt or ()), step.token)]
    return [x for t in scored for x in (t.token, t.logprob, *(v for pair in t.top for v in pair))]


@pytest.fixture
def slow_prefill(monkeypatch):
    """Prompt pieces launched beside the decode steps stay in flight for 4 checks (a slow
    device's: on the CPU they are done once launched), however many steps that takes."""
    hold = 4
    ready = InFlight.ready

    def slow(self):
        self.checks = getattr(self, "checks", 0) + 1
        return self.checks > hold and ready(self)

    monkeypatch.setattr(InFlight, "ready", slow)


@pytest.mark.parametrize("padded", [False, True])  # eager pieces; padded to a graph's shape, as on CUDA
def test_prompt_pieces_beside_decode_steps_leave_every_sequence_as_alone(torch_backend, slow_prefill, padded):
    """With prompt pieces run beside the decode steps (CUDA's second stream; held in flight here
    for a few steps each), streams decode on while a prompt is prefilled, its first token comes
    with the step that finds its last piece done, and every sequence decodes as alone: greedy,
    seeded, with prompt logprobs, and when a stream leaves, which moves the prompt's row while
    its piece runs."""
    weights = torch_backend.decoder_weights
    long = torch_backend.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 4))
    sequences = [
        Sequence(0, torch_backend.encode("Once upon"), Sampling(), 30),
        Sequence(1, torch_backend.encode("Hello world"), Sampling(temperature=0.9, seed=3), 30),
        Sequence(2, long, Sampling(), 12),
        Sequence(
            3, torch_backend.encode("Alice: How are you today?\nBob:"), Sampling(), 10, logprobs=2, prompt_logprobs=2
        ),
        Sequence(4, torch_backend.encode("zq"), Sampling(temperature=1.2, seed=8), 20, logprobs=1),
    ]
    decoder = BatchedDecoder(weights, 4, prefill_chunk=8, overlap_prefill=True, prefill_graphs=padded)
    beside = []  # steps that gave streams tokens while pieces were still in flight
    launched = []  # the passes of each launch seen in flight

    def watch(step, tokens):
        if decoder.state.pieces is not None and tokens:
            beside.append(step)
            launched.append(len(decoder.state.pieces.passes))

    out = drive(decoder, sequences, arrive_at={2: 2, 3: 5, 4: 9}, stop_after={0: 6}, on_tokens=watch)
    assert len(beside) >= 6
    assert max(launched) >= len(long) // 8  # a prompt's pieces launched together, one after another
    assert (decoder.network._padded_inputs is not None) == padded
    assert len(out.ids[0]) == 6
    for sequence in sequences[1:]:
        single = drive(BatchedDecoder(weights, 1), [sequence])
        assert out.ids[sequence.id] == single.ids[sequence.id], sequence.id
        if sequence.logprobs is not None:  # the same tokens scored, to float32's rounding
            assert flat(out.logprobs[sequence.id]) == pytest.approx(flat(single.logprobs[sequence.id]), abs=1e-4)
    assert not decoder.rows and decoder.state.pieces is None


def test_a_sequence_that_leaves_while_its_prompt_pieces_run_disturbs_no_other(torch_backend, slow_prefill):
    weights = torch_backend.decoder_weights
    stream = Sequence(1, torch_backend.encode("Once upon"), Sampling(), 24)
    leaving = Sequence(2, torch_backend.encode("The quick brown fox jumps over the lazy dog. " * 3), Sampling(), 8)
    after = Sequence(3, torch_backend.encode("Hello world"), Sampling(), 10)
    decoder = BatchedDecoder(weights, 2, prefill_chunk=8, overlap_prefill=True)
    ids: dict[int, list[int]] = {1: [], 3: []}

    def step():
        for seq_id, tokens in decoder.step().items():
            ids[seq_id] += tokens
        decoder.remove(*[s.sequence.id for s in decoder.rows if len(s.generated) >= s.sequence.max_new_tokens])

    decoder.add(stream)
    while not ids[1]:
        step()
    decoder.add(leaving)
    for _ in range(2):
        step()  # the stream decodes while the other's first piece runs
    assert decoder.state.pieces is not None and len(ids[1]) == 3
    decoder.remove(2)
    assert decoder.state.pieces is None  # its pieces are not read: nobody waits for them
    decoder.add(after)  # takes the pages the leaver gave back
    while decoder.rows:
        step()
    assert ids[1] == drive(BatchedDecoder(weights, 1), [stream]).ids[1]
    assert ids[3] == drive(BatchedDecoder(weights, 1), [after]).ids[3]


@pytest.mark.parametrize("cut", [(5, 12), (150, 170)])  # the second after the cache has grown
def test_a_sequence_leaving_the_middle_of_the_batch_disturbs_no_other(torch_backend, cut):
    # Removing slot 1 of 4 moves the last sequence into it: its cache must move intact.
    requests = [(p, 200, Sampling()) for p in PROMPTS[:5]]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 4)
    out = run_batch(decoder, requests, torch_backend, cancel={1: cut[0], 0: cut[1]})
    for i in (2, 3, 4):
        assert out[i] == alone(torch_backend, requests[i][0], 200)
    assert len(out[1]) == cut[0] and len(out[0]) == cut[1]
    assert not decoder.rows  # every row was freed


def test_sequences_leaving_together_disturb_no_other(torch_backend):
    # Three of six end in one step (slots 0, 2 and 3): the engine removes them with one call,
    # and the last rows' sequences move into the freed ones together, their caches intact.
    requests = [(p, 60, Sampling()) for p in PROMPTS[:6]]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 6)
    out = run_batch(decoder, requests, torch_backend, cancel={0: 9, 2: 9, 3: 9})
    for i in (1, 4, 5):
        assert out[i] == alone(torch_backend, requests[i][0], 60), requests[i][0]
    assert [len(out[i]) for i in (0, 2, 3)] == [9, 9, 9]
    decoder.add(Sequence(9, torch_backend.encode("Once upon"), Sampling(), 5))
    decoder.remove(9, 12345)  # an id it does not hold is ignored
    assert not decoder.rows


def test_long_generations_grow_the_cache_and_give_it_back(torch_backend):
    requests = [("Once upon", 400, Sampling()), ("The quick brown", 150, Sampling())]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 2)
    out = run_batch(decoder, requests, torch_backend)
    usage = decoder.kv_cache_usage()
    assert usage.peak_bytes >= 400 * usage.bytes_per_token  # past 400 positions
    assert usage.used_bytes <= MIN_LENGTH_BUCKET * usage.bytes_per_token  # both left: one short row is kept
    assert usage.reserved_bytes == 0
    assert out[0] == alone(torch_backend, "Once upon", 400)
    assert out[1] == alone(torch_backend, "The quick brown", 150)


def test_rows_of_unlike_reach_attend_in_groups_and_decode_as_alone(torch_backend, reach_groups):
    """An eager step's rows attend in groups of like reach (`_reach_groups`: the CPU gathers a
    row's pages only up to its own length bucket): rows past 256 columns beside short ones, a
    sampled one, and one still prefilling, each decode as alone."""
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 24)  # 240 tokens
    requests = [
        (long, 40, Sampling()),
        ("Once upon", 60, Sampling()),
        ("Hello world", 50, Sampling(temperature=0.9, seed=3)),
        ("Alice: " + long[:300], 30, Sampling()),
        ("zq", 20, Sampling()),
    ]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 4, prefill_chunk=16)
    out = run_batch(decoder, requests, torch_backend)
    assert any(found is not None and len(found) >= 2 for found in reach_groups)
    for i, (prompt, n, sampling) in enumerate(requests):
        assert out[i] == alone(torch_backend, prompt, n, sampling), prompt


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(torch_backend):
    sampled = Sampling(temperature=1.5, top_p=0.9, seed=42)
    requests = [
        ("Hello world", 30, sampled),
        ("Once upon", 30, Sampling()),
        ("zq", 30, Sampling(temperature=2.0, seed=1)),
    ]
    out = run_batch(BatchedDecoder(torch_backend.decoder_weights, 3), requests, torch_backend)
    assert out[0] == alone(torch_backend, "Hello world", 30, sampled)
    assert out[2] == alone(torch_backend, "zq", 30, Sampling(temperature=2.0, seed=1))
    assert out[1] == alone(torch_backend, "Once upon", 30)


def test_matches_transformers_generic_path(torch_backend, reference):
    # The fast path's own arithmetic (fused q/k/v, rotary, the tanh GELU) against transformers'
    # generate on the same weights.
    for prompt in PROMPTS:
        decoder = BatchedDecoder(torch_backend.decoder_weights, 1)
        (out,) = run_batch(decoder, [(prompt, 30, Sampling())], torch_backend).values()
        ids = reference(prompt, 30)
        eos = reference.tokenizer.eos_token_id
        cut = ids.index(eos) + 1 if eos in ids else len(ids)  # generate stops at end-of-text
        assert out[:cut] == ids[:cut], prompt


def test_a_prompt_sent_again_takes_its_last_token_through_a_decode_step(torch_backend, monkeypatch):
    """All but its last token come from the prompt cache, and the last is a decode step's input
    (no one-token prefill: on CUDA that is ~500 eager launches against a graphed step); the
    tokens, greedy and seeded, are those of the first time."""
    decoder = BatchedDecoder(torch_backend.decoder_weights, 2, prompt_cache_bytes=1 << 24)
    prompt = torch_backend.encode("The quick brown fox jumps over the lazy dog")
    for sampling in (Sampling(), Sampling(temperature=1.3, top_p=0.9, seed=5)):
        first = drive(decoder, [Sequence(1, prompt, sampling, 12)]).ids[1]
        prefilled = []
        original = Prefill.run

        def counted(self, parts, *args, **kwargs):
            prefilled.extend(len(ids) for _, ids, _ in parts)
            return original(self, parts, *args, **kwargs)

        monkeypatch.setattr(Prefill, "run", counted)
        again = drive(decoder, [Sequence(2, prompt, sampling, 12)])
        monkeypatch.undo()
        assert again.ids[2] == first
        assert again.cached[2] == len(prompt) - 1
        assert not prefilled


def test_a_stored_prompt_is_shared_by_page_not_copied(torch_backend):
    """A prompt that starts as a stored one takes the stored pages into its own table (the page
    where the shared prefix ends part-way is copied); its output is the output without reuse,
    and the pages stay held until neither a row nor the cache holds them."""
    from backends.torch.kv_pages import PAGE

    weights = torch_backend.decoder_weights
    system = torch_backend.encode("A system prompt that many clients share, long enough for pages. " * 3)
    assert len(system) > 2 * PAGE + 1
    decoder = BatchedDecoder(weights, 4, prompt_cache_bytes=1 << 24)
    first = Sequence(0, system + torch_backend.encode(" First question?"), Sampling(), 5)
    decoder.add(first)
    while 0 not in decoder.step():  # its prefill completes: the prompt is stored
        pass
    stored_pages = list(decoder.kv.held[decoder.row_of[0]])
    second = Sequence(1, system + torch_backend.encode(" Another one?"), Sampling(), 8)
    reused = decoder.add(second)
    assert reused >= len(system) and reused > PAGE
    row = decoder.row_of[1]
    whole = reused // PAGE
    assert decoder.kv.held[row][:whole] == stored_pages[:whole]  # the same pages, no copy
    assert decoder.kv.held[row][whole] not in stored_pages  # a page it writes is its own
    assert decoder.kv.table[row, :whole].tolist() == stored_pages[:whole]
    tokens = {}
    while len(tokens.get(1, [])) < 8:
        for sequence_id, new in decoder.step().items():
            tokens.setdefault(sequence_id, []).extend(new)
    assert tokens[1][:8] == drive(BatchedDecoder(weights, 1), [second]).ids[1]
    decoder.remove(0, 1)
    kv = decoder.kv
    assert kv.row_pages == 0 and kv.held_pages > 0  # the cache holds them
    assert all(kv.kept_refs[page] > 0 for page in stored_pages[:whole])
    decoder.prompts.clear()
    assert kv.held_pages == 0 and sorted(kv.free) == list(range(1, kv.pages))


def test_ended_sequences_are_stored_as_they_leave_and_a_next_turn_reuses_them(torch_backend):
    """A sequence that ends is stored with its text as it leaves, by its pages (no copy, so no
    stall of the others that decode meanwhile); a next turn that extends one reuses all of it
    and decodes as without reuse."""
    weights = torch_backend.decoder_weights
    decoder = BatchedDecoder(weights, 8, prompt_cache_bytes=1 << 24)
    decoder.add(Sequence(0, torch_backend.encode("The long one keeps going"), Sampling(), 40))
    short = [
        Sequence(i, torch_backend.encode(f"{word} went to the market"), Sampling(), 3)
        for i, word in enumerate("ABCDEF", 1)
    ]
    for sequence in short:
        decoder.add(sequence)
    generated = {}
    while any(len(generated.get(s.id, [])) < 3 for s in short):
        for sequence_id, tokens in decoder.step().items():
            generated.setdefault(sequence_id, []).extend(tokens)
    rows_held = decoder.kv.row_pages
    decoder.remove(*(s.id for s in short))
    assert decoder.kv.row_pages < rows_held and decoder.prompt_cache_usage().entries >= len(short)
    first = short[0]
    extended = first.prompt_ids + generated[first.id] + torch_backend.encode(" and then")
    decoder.remove(0)
    turn = Sequence(9, extended, Sampling(), 6)
    reused = decoder.add(turn)
    assert reused == len(first.prompt_ids) + len(generated[first.id]) - 1  # its text but the last token
    got = []
    while len(got) < 6:
        got += decoder.step().get(9, [])
    assert got == drive(BatchedDecoder(weights, 1), [turn]).ids[9]


def test_prompts_sharing_stored_pages_in_every_alignment_decode_as_without_reuse(torch_backend):
    """Prompts that share prefixes of many lengths (ending on and between page boundaries, in
    and across the tree's nodes), three decoding at a time, some stored while others still
    decode: each one's ids are those of a decoder without a prompt cache."""
    import random

    weights = torch_backend.decoder_weights
    rng = random.Random(7)
    base = torch_backend.encode("Shared beginnings of many prompts, cut at every length. " * 4)
    prompts = []
    for i in range(14):
        cut = rng.randrange(3, len(base))
        prompts.append(base[:cut] + torch_backend.encode(f" branch {i % 5}") + base[: rng.randrange(0, 20)])
    sequences = [Sequence(i, p, Sampling(), 5) for i, p in enumerate(prompts)]
    shared = drive(BatchedDecoder(weights, 3, prompt_cache_bytes=1 << 24), sequences)
    assert sum(shared.cached.values()) > 0
    for sequence in sequences:
        assert shared.ids[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id]


def test_a_hit_gives_a_row_the_keys_and_values_of_its_own_prefix(torch_backend):
    """Read back from the pool: the columns a hit shares or copies into a row are those that
    prefilling its prompt computes, whichever stored sequence (of the tree's branches that
    share a page where one ends) they come from."""
    import random

    import torch

    from backends.torch.kv_pages import PAGE

    weights = torch_backend.decoder_weights
    rng = random.Random(11)
    base = torch_backend.encode("Shared beginnings of many prompts, cut at every length. " * 4)
    decoder = BatchedDecoder(weights, 2, prompt_cache_bytes=1 << 24)
    reference = BatchedDecoder(weights, 1)
    checked = 0
    for i in range(16):
        cut = rng.randrange(3, len(base))
        prompt = base[:cut] + torch_backend.encode(f" branch {i % 3} of {cut % 4}") + base[: rng.randrange(0, 30)]
        sequence = Sequence(i, prompt, Sampling(), 3)
        reused = decoder.add(sequence)
        if reused:
            held = decoder.kv.held[decoder.row_of[i]]
            reference.add(Sequence(100 + i, prompt, Sampling(), 1))
            while 100 + i not in reference.step():
                pass
            expected = reference.kv.columns_of(reference.kv.held[0], 0, reused)
            got = decoder.kv.columns_of(held, 0, reused)
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, expected, strict=True)), (i, reused)
            reference.remove(100 + i)
            checked += reused % PAGE != 0
        while len(decoder.rows[decoder.row_of[i]].generated) < 3:
            decoder.step()
        decoder.remove(i)
    assert checked >= 3
