"""The MLX runtime (mlx-lm's own models) on the tiny checkpoints of the families (backends/torch/tiny.py),
against transformers' forward as test_families holds the Torch decoder to it: float32 logits at
the prompt and at each of 20 greedy steps, batched equals alone, a prompt-cache hit equals a cold
run.

Families whose mlx-lm model computes something else than transformers' at these shapes are left
out, as mlx-lm's gaps, not the server's: Mistral's and Qwen2's sliding windows (mlx-lm attends to
every column past the window), Phi-3's longrope with a partial rotary (its logits differ from the
first token).
"""

from __future__ import annotations

import pytest
import torch
from test_families import prompt_of, reference_steps

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drive import drive
from backends.torch.tiny import write_tiny_family

pytest.importorskip("mlx_lm")

MLX_FAMILIES = ["gemma3_text", "gemma4_text", "smollm3", "qwen3_5_text", "llama", "qwen3"]


@pytest.fixture(scope="module", params=MLX_FAMILIES)
def pair(request, tiny_path, tmp_path_factory):
    """(Torch backend, MLX backend) of one family's tiny checkpoint."""
    path = write_tiny_family(tmp_path_factory.mktemp("mlx-families") / request.param, request.param, tiny_path)
    options = LoadOptions(model=str(path), dtype="float32", warmup=False)
    return load_backend("torch", options), load_backend("mlx", options)


def test_logits_equal_transformers_at_every_step(pair):
    """40 tokens: past Gemma 3's local window (16) and into SmolLM3's NoPE layer's reach."""
    import mlx.core as mx
    import numpy as np

    torch_backend, mlx_backend = pair
    prompt = prompt_of(40)
    expected_ids, expected_logits = reference_steps(torch_backend, prompt, 20)
    scale = max(1.0, float(expected_logits[0].abs().max()))
    first = torch.from_numpy(np.array(mlx_backend.model(mx.array([prompt]))[0, -1].astype(mx.float32)))
    assert float((first - expected_logits[0]).abs().max()) <= 1e-5 * scale
    got = drive(mlx_backend.decoder(1), [Sequence(1, prompt, Sampling(), 20, logprobs=5)])
    assert got.ids[1] == expected_ids
    for scores, logits in zip(got.logprobs[1], expected_logits, strict=True):
        reference = torch.log_softmax(logits, dim=-1)
        for token, logprob in (*scores.token.top, (scores.token.token, scores.token.logprob)):
            assert abs(logprob - float(reference[token])) <= 1e-5 * scale


def test_batched_equals_alone(pair):
    _, mlx_backend = pair
    sequences = [Sequence(i, prompt_of(n), Sampling(), 20 + 2 * i) for i, n in enumerate([3, 30, 17, 45, 9])]
    together = drive(mlx_backend.decoder(4), sequences, arrive_at={3: 4, 4: 7}).ids
    for sequence in sequences:
        assert together[sequence.id] == drive(mlx_backend.decoder(1), [sequence]).ids[sequence.id], sequence.id


@pytest.mark.parametrize("batch", [1, 4], ids=["alone", "batched"])
def test_a_prompt_cache_hit_equals_a_cold_run(pair, batch):
    """A chat's next turn: the first prompt, its reply and more. (Gemma 3's local layers keep
    mlx-lm's RotatingKVCache, and Qwen3.5's linear layers a state, neither of which can be cut
    back: an entry serves prompts that extend it.)"""
    _, mlx_backend = pair
    first = prompt_of(40)
    warm = mlx_backend.decoder(batch, prompt_cache_bytes=1 << 24)
    reply = drive(warm, [Sequence(1, first, Sampling(), 12)]).ids[1]
    longer = first + reply + prompt_of(50)[-20:]
    hit = drive(warm, [Sequence(2, longer, Sampling(), 20)])
    assert hit.cached[2] >= 40
    cold = drive(mlx_backend.decoder(batch, prompt_cache_bytes=0), [Sequence(2, longer, Sampling(), 20)])
    assert cold.cached[2] == 0
    assert hit.ids[2] == cold.ids[2]
