"""Qwen3.5's hybrid stack in the batched Torch decoder (backends/torch/hybrid.py): Gated DeltaNet
layers with a state per sequence beside the paged KV of its attention layers, on a tiny checkpoint
of its real shape (backends/torch/tiny.py HYBRID_FAMILIES: three linear-attention layers to one
gated attention layer, random weights), held to transformers' forward as test_families holds
the other families: logits at every step, batched equals alone (prompts prefilled in pieces
while others decode, rows moving as others leave), and the server batching it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import engine_of
from test_families import prompt_of, reference_steps

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drive import drive
from backends.torch.decoder import BatchedDecoder
from backends.torch.tiny import HYBRID_FAMILIES, write_tiny_family

pytest.importorskip("transformers.models.qwen3_5")


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def hybrid(request, tiny_path, tmp_path_factory):
    path = write_tiny_family(tmp_path_factory.mktemp("hybrid") / request.param, request.param, tiny_path)
    return load_backend("torch", LoadOptions(model=str(path), dtype="float32", warmup=False))


def test_it_takes_the_batched_decoder(hybrid):
    arch = hybrid.decoder_weights.arch
    assert arch.mixers.count("delta") == 6 and arch.mixers.count("attention") == 2
    assert isinstance(hybrid.decoder(4), BatchedDecoder)


@pytest.mark.parametrize("length", [10, 40, 70])
def test_logits_equal_transformers_at_every_step(hybrid, length):
    prompt = prompt_of(length)
    expected_ids, expected_logits = reference_steps(hybrid, prompt, 20)
    weights = hybrid.decoder_weights
    scale = max(1.0, float(expected_logits[0].abs().max()))
    first = BatchedDecoder(weights, 1).logits_after(prompt)
    assert float((first - expected_logits[0]).abs().max()) <= 1e-5 * scale
    got = drive(BatchedDecoder(weights, 1), [Sequence(1, prompt, Sampling(), 20, logprobs=5)])
    assert got.ids[1] == expected_ids
    for scores, logits in zip(got.logprobs[1], expected_logits, strict=True):
        reference = torch.log_softmax(logits, dim=-1)
        for token, logprob in (*scores.token.top, (scores.token.token, scores.token.logprob)):
            assert abs(logprob - float(reference[token])) <= 1e-5 * scale


def test_batched_equals_alone(hybrid):
    """Pieces of 16: the longer prompts are prefilled in several, in the decode steps' pass
    (`mixed_step`), each from its row's state; rows leave and the last ones move into their place."""
    weights = hybrid.decoder_weights
    lengths = [3, 30, 17, 70, 9, 45]
    sequences = [
        Sequence(i, prompt_of(n), Sampling() if i % 2 else Sampling(temperature=0.9, seed=i), 12 + 3 * i)
        for i, n in enumerate(lengths)
    ]
    together = drive(BatchedDecoder(weights, 4, prefill_chunk=16), sequences, arrive_at={4: 5, 5: 9}).ids
    for sequence in sequences:
        assert together[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id], sequence.id
        if sequence.sampling.greedy:
            assert together[sequence.id] == reference_steps(hybrid, sequence.prompt_ids, sequence.max_new_tokens)[0]


def test_no_stored_prefix_serves_it(hybrid):
    """Its states are not kept at page boundaries: the prompt cache is off for it, and a prompt
    sent again is computed again, to the same tokens."""
    decoder = BatchedDecoder(hybrid.decoder_weights, 2, prompt_cache_bytes=1 << 24, draft_tokens=4)
    assert decoder.prompts.limit_bytes <= 0 and decoder.draft_tokens == 0
    prompt = prompt_of(40)
    first = drive(decoder, [Sequence(1, prompt, Sampling(), 12)])
    again = drive(decoder, [Sequence(2, prompt, Sampling(), 12)])
    assert again.cached[2] == 0 and again.ids[2] == first.ids[1]


async def test_the_server_batches_it(make_client, hybrid):
    client = await make_client(lambda: hybrid, max_batch=4)
    bodies = [{"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "temperature": 0} for _ in range(6)]
    responses = await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
    assert [r.status for r in responses] == [200] * 6
    texts = {(await r.json())["text"] for r in responses}
    assert len(texts) == 1  # the same prompt, greedy: the same text in any company
    assert isinstance(engine_of(client)._decoder, BatchedDecoder)
