"""Prompt-lookup speculative decoding (backends/prompt_lookup, PROMPT_LOOKUP_TOKENS): drafts
come from the text's own earlier n-grams, every decoder verifies them in one pass, and the
text is the one decoding a token a step gives (greedy), or follows the same distribution
(sampled), on both runtimes, in the batched and the one-at-a-time decoders, and through the app."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from backends.contract import Sampling, Sequence
from backends.decoding.drafts import PromptLookup, accepted, speculates
from backends.decoding.drive import drive
from tests.conftest import engine_of

# The tiny model falls into loops that repeat its prompt's and its own n-grams: drafts are
# accepted often. An arbitrary text, so that some drafts are rejected too.
REPEATING = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3
PLAIN = "The quick brown fox jumps over the lazy dog near the river bank"


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_ngram():
    lookup = PromptLookup([5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3], max_draft=10)
    assert lookup.draft(3, 100) == [7, 6, 1]  # (1, 2, 3) last came before 7, not before 9
    assert lookup.draft(10, 100) == [7, 6, 1, 2, 3]  # as far as the text goes
    assert lookup.draft(10, 7) == []  # not past an id the model cannot generate
    assert lookup.draft(0, 100) == []
    lookup.catch_up([4])
    assert lookup.draft(2, 100) == []  # (2, 3, 4) and (3, 4) never occurred before
    # The longest n-gram that recurs wins over a shorter one that recurs later.
    lookup = PromptLookup([1, 2, 3, 10, 11, 2, 3, 20, 1, 2, 3], max_draft=4)
    assert lookup.draft(2, 100) == [10, 11]
    assert PromptLookup([1, 2, 3], 4).draft(4, 100) == []  # its own last n-gram is no match
    assert PromptLookup([7, 7, 7], 4).draft(4, 100) == [7]  # (7, 7) occurred once before, then 7


def test_the_drafts_length_follows_what_the_model_accepts():
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], max_draft=4)
    assert lookup.draft(99, 100) == [3, 4, 5, 6]
    lookup.verified([3, 4, 5, 6], [3, 8])  # rejected at its second token
    assert lookup.length == 3 and lookup.ids[-2:] == [3, 8]
    for _ in range(5):
        lookup.verified([1], [2])
    assert lookup.length == 1  # never below 1
    lookup.verified([1], [1, 2])  # kept whole
    assert lookup.length == 3
    lookup.verified([1, 2, 3], [1, 2, 3, 4])
    assert lookup.length == 4  # never above PROMPT_LOOKUP_TOKENS


def test_greedy_verification_keeps_the_draft_while_the_model_agrees():
    assert accepted([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accepted([5, 6], [5, 6, 8]) == [5, 6, 8]  # a draft kept whole, and the model's next token
    assert accepted([5], [4, 2]) == [4]


def test_only_sequences_chosen_from_the_raw_logits_without_a_seed_take_drafts():
    def takes(sampling=Sampling(), **fields):
        return speculates(Sequence(1, [1, 2], sampling, 8, **fields))

    assert takes() and takes(Sampling(temperature=0.8, top_p=0.9, top_k=5, min_p=0.05))
    assert not takes(logprobs=0) and not takes(prompt_logprobs=1)
    assert not takes(Sampling(repetition_penalty=1.2)) and not takes(Sampling(logit_bias=((3, 1.0),)))
    assert not takes(Sampling(temperature=0.8, seed=3))  # a seed promises the same text in any batch
    assert takes(Sampling(seed=3))  # greedy: the seed draws nothing


def decoders(request, runtime: str, max_batch: int, drafts: int, monkeypatch):
    backend = request.getfixturevalue(f"{runtime}_backend")
    monkeypatch.setattr(backend, "draft_tokens", drafts)
    return backend, backend.decoder(max_batch, prompt_cache_bytes=0)


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_greedy_text_is_the_same_with_drafts_in_fewer_steps(request, monkeypatch, runtime, max_batch):
    backend, plain = decoders(request, runtime, max_batch, 0, monkeypatch)
    sequences = [Sequence(i, backend.encode(text), Sampling(), 150) for i, text in enumerate([REPEATING, PLAIN])]
    expected = {s.id: drive(plain, [s]) for s in sequences}
    backend, drafted = decoders(request, runtime, max_batch, 4, monkeypatch)
    for s in sequences:
        got = drive(drafted, [s])
        assert got.ids[s.id] == expected[s.id].ids[s.id], s.id
    # The tiny model falls into a loop: after it, tokens come from accepted drafts; at once for the
    # repeated prompt.
    assert got.steps < expected[1].steps
    assert drive(drafted, [sequences[0]]).steps < expected[0].steps / 2


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_a_second_sequence_ends_the_drafts_and_both_decode_as_alone(request, monkeypatch, runtime):
    # The first decodes alone with drafts; the second joins at step 5 (the batch then verifies no
    # drafts: on MLX the first moves into BatchGenerator with its cache), and leaves the first
    # alone again for its last tokens.
    backend, plain = decoders(request, runtime, 4, 0, monkeypatch)
    first = Sequence(1, backend.encode(REPEATING), Sampling(), 120)
    second = Sequence(2, backend.encode(PLAIN), Sampling(), 30)
    alone = {s.id: drive(plain, [s]).ids[s.id] for s in (first, second)}
    backend, drafted = decoders(request, runtime, 4, 4, monkeypatch)
    got = drive(drafted, [first, second], arrive_at={2: 5})
    assert got.ids == alone


def test_a_draft_never_goes_past_max_tokens(request, monkeypatch):
    # Each step's tokens fit what the sequence may still generate: its KV stays within what the
    # budget reserved (prompt + max_tokens).
    backend, decoder = decoders(request, "torch", 4, 4, monkeypatch)
    for n in (1, 2, 3, 5, 9):
        decoder.add(Sequence(n, backend.encode(REPEATING), Sampling(), n))
        got = []
        while len(got) < n:
            got += decoder.step().get(n, [])
        assert len(got) == n
        decoder.remove(n)


# -- sampled: the acceptance rule ----------------------------------------------------------------

LOGITS = [[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 1.0, 0.0, 0.7]]
TRIALS = 20_000


def softmax(row: list[float], scale: float = 1.0) -> list[float]:
    exps = [math.exp(x * scale) for x in row]
    return [e / sum(exps) for e in exps]


def close(counts: Counter, probs: list[float]) -> bool:
    """Whether draws are within sqrt(V / n) of `probs` in total variation: about 2.5 times what
    n exact draws stray by (~0.4 sqrt(V / n)), and 0.017 at n = 20,000."""
    total = sum(counts.values())
    distance = sum(abs(counts.get(i, 0) / total - p) for i, p in enumerate(probs)) / 2
    return distance < math.sqrt(len(probs) / total)


def check_rule(verify, draft: int, temperature: float) -> None:
    """The first token follows p_0, and after an accepted draft the second follows p_1, whatever
    the draft: over TRIALS draws from fixed seeds (the test is deterministic). A rule that kept
    the draft more or less often than p_0 gives, or drew the rejected draft again, would shift
    the first token's distribution by far more."""
    first, second = Counter(), Counter()
    for trial in range(TRIALS):
        tokens = verify(trial)
        first[tokens[0]] += 1
        if tokens[0] == draft:
            assert len(tokens) == 2
            second[tokens[1]] += 1
        else:
            assert len(tokens) == 1  # a rejection ends the step
    scale = 1 / temperature
    assert close(first, softmax(LOGITS[0], scale)), first
    assert close(second, softmax(LOGITS[1], scale)), second


@pytest.mark.parametrize("draft", [0, 4])  # the likeliest token, and an unlikely one
def test_torch_sampled_drafts_follow_the_models_distribution(draft):
    import torch

    from backends.torch.sampling import TokenChooser, verify_draft

    logits = torch.tensor(LOGITS)

    def verify(trial: int) -> list[int]:
        chooser = TokenChooser(Sampling(temperature=0.7, seed=trial), [], 6, torch.device("cpu"))
        return verify_draft(logits, [draft], chooser)

    check_rule(verify, draft, 0.7)


@pytest.mark.parametrize("draft", [0, 4])
def test_mlx_sampled_drafts_follow_the_models_distribution(draft):
    import mlx.core as mx

    from backends.mlx.drafts import verify_draft

    logits = mx.array(LOGITS)
    sampling = Sampling(temperature=0.7)
    check_rule(lambda trial: verify_draft(logits, [draft], sampling, 6, mx.random.key(trial))[0], draft, 0.7)


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_sampled_sequences_take_drafts_and_decode_to_their_length(request, monkeypatch, runtime):
    backend, decoder = decoders(request, runtime, 4, 4, monkeypatch)
    sequence = Sequence(1, backend.encode(REPEATING), Sampling(temperature=0.3, top_p=0.95), 100)
    got = drive(decoder, [sequence])
    assert len(got.ids[1]) == 100 and got.steps < 100


# -- through the app -----------------------------------------------------------------------------


async def test_the_server_ends_a_reply_within_a_steps_tokens(make_client, backend, max_batch, monkeypatch):
    """max_tokens, stop strings and the token counts hold when a step brings several tokens, and
    the text is the greedy text decoded a token a step."""
    monkeypatch.setattr(backend, "draft_tokens", 0)
    prompt_ids = backend.encode(REPEATING)
    plain = drive(backend.decoder(1, prompt_cache_bytes=0), [Sequence(1, prompt_ids, Sampling(), 61)]).ids[1]
    monkeypatch.setattr(backend, "draft_tokens", 4)
    client = await make_client(lambda: backend)
    for n in (1, 7, 61):
        response = await client.post("/generate", json={"prompt": REPEATING, "max_tokens": n, "ignore_eos": True})
        assert response.status == 200, await response.text()
        body = await response.json()
        assert body["tokens_used"] == n and body["text"] == backend.decode(plain[:n])
    text = backend.decode(plain)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    response = await client.post(
        "/generate", json={"prompt": REPEATING, "max_tokens": 61, "stop": [stop], "ignore_eos": True}
    )
    body = await response.json()
    assert body["finish_reason"] == "stop" and body["text"] == text[: text.find(stop)]
    stats = engine_of(client).stats
    assert stats.draft_tokens_accepted > 0
    info = await (await client.get("/model/info")).json()
    assert info["prompt_lookup_tokens"] == 4 and info["stats"]["draft_tokens_accepted"] == stats.draft_tokens_accepted
    metrics = await (await client.get("/metrics")).text()
    assert f"phi2_draft_tokens_accepted_total {float(stats.draft_tokens_accepted)}" in metrics
