"""The batched Phi decoder (backends/torch_decoder.py) on the CPU: every sequence in a batch
decodes exactly as it would alone, whoever joins or leaves, however long its prompt."""

from __future__ import annotations

import pytest

from backends import Sampling, Sequence
from backends.drive import drive
from backends.torch_decoder import MIN_LENGTH_BUCKET, BatchedDecoder, supports

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
    # CUDA's graphed prefill of new prompts (`_prefill_fresh`), run eagerly on the CPU.
    requests = [(p, n, Sampling()) for p, n in zip(PROMPTS, [40, 7, 90, 1, 33, 60, 25], strict=False)]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 4, prefill_graphs=True)
    out = run_batch(decoder, requests, torch_backend)
    assert decoder._fresh_inputs is not None
    for i, (prompt, n, _) in enumerate(requests):
        assert out[i] == alone(torch_backend, prompt, n), prompt


@pytest.mark.parametrize("cut", [(5, 12), (150, 170)])  # the second after the cache has grown
def test_a_sequence_leaving_the_middle_of_the_batch_disturbs_no_other(torch_backend, cut):
    # Removing slot 1 of 4 moves the last sequence into it: its cache must move intact.
    requests = [(p, 200, Sampling()) for p in PROMPTS[:5]]
    decoder = BatchedDecoder(torch_backend.decoder_weights, 4)
    out = run_batch(decoder, requests, torch_backend, cancel={1: cut[0], 0: cut[1]})
    for i in (2, 3, 4):
        assert out[i] == alone(torch_backend, requests[i][0], 200)
    assert len(out[1]) == cut[0] and len(out[0]) == cut[1]
    assert not decoder.slots  # every slot was freed


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
    assert not decoder.slots


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
        original = BatchedDecoder._prefill

        def counted(self, parts, *args, **kwargs):
            prefilled.extend(len(ids) for _, ids, _ in parts)
            return original(self, parts, *args, **kwargs)

        monkeypatch.setattr(BatchedDecoder, "_prefill", counted)
        again = drive(decoder, [Sequence(2, prompt, sampling, 12)])
        monkeypatch.undo()
        assert again.ids[2] == first
        assert again.cached[2] == len(prompt) - 1
        assert not prefilled


def test_complete_prompts_are_stored_a_few_a_step(torch_backend):
    """Storing a prompt is a gather per layer: 64 at once stalled every stream on an H200, so a
    step stores STORES_PER_STEP of them, oldest first, and the outputs do not change."""
    from backends.torch_decoder import STORES_PER_STEP

    weights = torch_backend.decoder_weights
    prompts = [torch_backend.encode(f"{word} went to the market") for word in "ABCDEFGH"]
    sequences = [Sequence(i, p, Sampling(), 6) for i, p in enumerate(prompts)]
    decoder = BatchedDecoder(weights, 8, prompt_cache_bytes=1 << 24)
    for sequence in sequences:
        decoder.add(sequence)
    stored = []
    tokens = {}
    for _ in range(3):
        for sequence_id, new in decoder.step().items():
            tokens.setdefault(sequence_id, []).extend(new)
        stored.append(decoder.prompt_cache_usage().entries)
    assert stored == [0, STORES_PER_STEP, 2 * STORES_PER_STEP]
    for sequence in sequences:
        got = tokens[sequence.id]
        assert len(got) >= 2 and got == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id][: len(got)]


def test_ended_sequences_are_stored_a_few_a_step_while_others_decode(torch_backend):
    """A sequence that ends keeps its pages until its prompt and text are copied into the prompt
    cache, a few a step while others decode (not all at once, a stall of every stream); a next
    turn that extends one then reuses all of it."""
    from backends.torch_decoder import STORES_PER_STEP

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
    held = decoder.kv_cache_usage().blocks_used
    decoder.remove(*(s.id for s in short))
    assert decoder.kv_cache_usage().blocks_used == held  # their pages wait to be read
    waiting = []
    for _ in range(2):
        decoder.step()
        waiting.append(len(decoder._leaving))
    assert waiting == [len(short) - STORES_PER_STEP, 0]
    assert decoder.kv_cache_usage().blocks_used < held
    first = short[0]
    extended = first.prompt_ids + generated[first.id] + torch_backend.encode(" and then")
    decoder.remove(0)
    reused = decoder.add(Sequence(9, extended, Sampling(), 2))
    assert reused == len(first.prompt_ids) + len(generated[first.id]) - 1  # its text but the last token
