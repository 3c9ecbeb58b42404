"""Token choice on both runtimes, held to transformers' own logits processors (no model needed).

Each runtime's `process` must keep the same ids and give the same distribution as
transformers' processors composed in `generate`'s order; presence and frequency penalties,
which transformers lacks, are checked against OpenAI's formula written out here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from backends.contract import Sampling
from backends.mlx import sampling as mlx_sampling
from backends.mlx.sampling import SequenceSampler, greedy_sampler, make_sampler
from backends.torch import sampling as torch_sampling
from backends.torch.sampling import TokenChooser

VOCAB, DECODABLE = 1024, 900
CPU = torch.device("cpu")


def random_logits(seed: int) -> torch.Tensor:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[DECODABLE:] += 30  # the undecodable ids would win everything if they were not excluded
    return logits


def histories(logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """A prompt and generated ids with repeats, holding the likeliest ids (so penalties matter)."""
    top = torch.argsort(logits[:DECODABLE], descending=True).tolist()
    prompt = [top[0], top[2], top[2], 17, top[5], 1000, 17]  # 1000: not decodable, ignored
    generated = [top[1], top[1], top[1], top[2], top[3], 5, 17]
    return prompt, generated


def counts_of(ids: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=VOCAB)[:DECODABLE].float()


def reference(logits: torch.Tensor, sampling: Sampling, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' processors in generate's order, presence/frequency written out (OpenAI's)."""
    input_ids = torch.tensor([prompt + generated])
    scores = logits[None, :DECODABLE].clone()
    bias = {(i,): b for i, b in sampling.logit_bias if i < DECODABLE}
    if bias:
        scores = SequenceBiasLogitsProcessor(bias)(input_ids, scores)
    if sampling.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(input_ids, scores)
    count = counts_of(generated)
    scores = scores - sampling.frequency_penalty * count - sampling.presence_penalty * (count > 0).float()
    if not sampling.greedy:
        warpers = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k:
            warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(sampling.top_p))
        if sampling.min_p:
            warpers.append(MinPLogitsWarper(sampling.min_p))
        for warper in warpers:
            scores = warper(input_ids, scores)
    return scores[0]


def torch_process(logits, sampling, prompt, generated) -> torch.Tensor:
    seen = torch.zeros(DECODABLE, dtype=torch.bool)
    seen[[i for i in prompt if i < DECODABLE]] = True
    return torch_sampling.process(logits, sampling, DECODABLE, seen, counts_of(generated))


def mlx_process(logits, sampling, prompt, generated) -> torch.Tensor:
    seen = np.zeros(DECODABLE, dtype=bool)
    seen[[i for i in prompt if i < DECODABLE]] = True
    counts = mx.array(counts_of(generated).numpy())
    row = mlx_sampling.process(mx.array(logits.numpy())[None], sampling, DECODABLE, mx.array(seen), counts)
    return torch.from_numpy(np.array(row[0]))


PROCESS = {"torch": torch_process, "mlx": mlx_process}

BIAS = ((3, 4.0), (10, -2.5), (11, -100.0), (905, 50.0))  # 905: not decodable, ignored
SETTINGS = [
    Sampling(temperature=0.0, repetition_penalty=1.3),
    Sampling(temperature=0.0, repetition_penalty=0.8, logit_bias=BIAS),
    Sampling(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
    Sampling(temperature=1.0, repetition_penalty=1.3),
    Sampling(temperature=0.7, repetition_penalty=0.8),
    Sampling(temperature=1.5, logit_bias=BIAS),
    Sampling(temperature=0.7, top_k=1),
    Sampling(temperature=1.5, top_k=5),
    Sampling(temperature=0.7, top_k=50),
    Sampling(temperature=0.7, top_p=0.3),
    Sampling(temperature=1.5, top_p=0.9),
    Sampling(temperature=0.7, min_p=0.05),
    Sampling(temperature=1.5, min_p=0.2),
    Sampling(temperature=1.5, presence_penalty=1.5, frequency_penalty=-0.5),
    Sampling(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3, logit_bias=BIAS),
    Sampling(temperature=1.5, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=0.8, frequency_penalty=0.3),
    Sampling(temperature=1.5, top_k=5, top_p=0.3, min_p=0.2, presence_penalty=0.5, logit_bias=BIAS),
    Sampling(
        temperature=0.7, top_p=0.9, min_p=0.2, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.2
    ),
]


@pytest.mark.parametrize("runtime", PROCESS)
@pytest.mark.parametrize("sampling", SETTINGS, ids=[f"s{i}" for i in range(len(SETTINGS))])
def test_process_matches_transformers(runtime, sampling):
    for seed in range(3):
        logits = random_logits(seed)
        prompt, generated = histories(logits)
        ours = PROCESS[runtime](logits, sampling, prompt, generated)
        expected = reference(logits, sampling, prompt, generated)
        assert ours.dtype == torch.float32 and ours.shape == (DECODABLE,)
        kept = torch.isfinite(ours)
        assert torch.equal(kept, torch.isfinite(expected))
        if not sampling.greedy:
            # A filter that kept everything would pass the comparison unnoticed.
            filters = sampling.top_k or sampling.top_p < 1 or sampling.min_p
            assert 0 < int(kept.sum()) and (int(kept.sum()) < DECODABLE or not filters)
        torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(expected, -1), atol=1e-5, rtol=0)
        assert int(torch.argmax(ours)) == int(torch.argmax(expected))
        if sampling.greedy:
            torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-6)


def test_process_leaves_the_row_alone_and_works_in_float32():
    logits = random_logits(0).to(torch.bfloat16)
    before = logits.clone()
    sampling = Sampling(temperature=0.7, repetition_penalty=1.3, logit_bias=BIAS, top_p=0.9)
    ours = torch_process(logits, sampling, [1, 2], [3])
    assert ours.dtype == torch.float32 and torch.equal(logits, before)
    row = mlx_sampling.process(mx.array(logits.float().numpy()).astype(mx.bfloat16), sampling, DECODABLE)
    assert row.dtype == mx.float32


# -- Torch: TokenChooser


def test_plain_only_when_greedy_and_unprocessed():
    assert TokenChooser(Sampling(), [1], DECODABLE, CPU).plain
    others = (
        Sampling(temperature=1.0),
        Sampling(logit_bias=((1, 1.0),)),
        Sampling(repetition_penalty=1.1),
        Sampling(frequency_penalty=0.1),
    )
    for sampling in others:
        assert not TokenChooser(sampling, [1], DECODABLE, CPU).plain
    plain = TokenChooser(Sampling(), [1], DECODABLE, CPU)
    assert plain.counts is None and plain.prompt_seen is None and plain.generator is None
    assert plain.choose(random_logits(0)) < DECODABLE  # the undecodable ids hold the largest logits


def choices(chooser, rows) -> list[int]:
    return [chooser.choose(row) for row in rows]


def test_torch_seeds():
    rows = [random_logits(i) for i in range(20)]
    sampling = Sampling(temperature=1.5, seed=7, repetition_penalty=1.3, presence_penalty=0.5)
    first = choices(TokenChooser(sampling, [1, 2], DECODABLE, CPU), rows)
    assert first == choices(TokenChooser(sampling, [1, 2], DECODABLE, CPU), rows)
    other = Sampling(temperature=1.5, seed=8, repetition_penalty=1.3, presence_penalty=0.5)
    assert first != choices(TokenChooser(other, [1, 2], DECODABLE, CPU), rows)
    # A fresh draw each step: the same row does not give the same token every time.
    assert len(set(choices(TokenChooser(Sampling(temperature=1.5, seed=7), [], DECODABLE, CPU), rows[:1] * 10))) > 1


def test_torch_choices_stay_in_the_kept_set():
    sampling = Sampling(temperature=1.5, top_k=5, top_p=0.9, seed=1)
    chooser = TokenChooser(sampling, [], DECODABLE, CPU)
    for i in range(40):
        row = random_logits(i)
        kept = torch.isfinite(torch_sampling.process(row, sampling, DECODABLE)).nonzero().flatten().tolist()
        assert 1 < len(kept) <= 5
        assert chooser.choose(row) in kept


def test_torch_top_k_1_is_the_processed_argmax():
    sampling = Sampling(temperature=1.0, top_k=1, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=BIAS)
    chooser = TokenChooser(sampling, [3, 4], DECODABLE, CPU)
    row = random_logits(0)  # the same row each step: the penalties move the argmax
    tokens = []
    for _ in range(6):
        expected = int(torch.argmax(chooser.scores(row)))
        tokens.append(chooser.choose(row))
        assert tokens[-1] == expected
    assert len(set(tokens)) > 1


def staircase() -> torch.Tensor:
    """10, 9.9, 9.8, ...: with a penalty that halves a seen id, greedy walks down the stairs."""
    row = torch.full((VOCAB,), -5.0)
    row[:20] = 10 - 0.1 * torch.arange(20)
    row[DECODABLE:] = 50.0
    return row


def test_torch_repetition_penalty_sees_the_prompt_and_the_choices():
    chooser = TokenChooser(Sampling(repetition_penalty=2.0), [0], DECODABLE, CPU)
    assert choices(chooser, [staircase()] * 4) == [1, 2, 3, 4]
    chooser.record(5)  # chosen outside choose()
    assert chooser.choose(staircase()) == 6


def openai_penalized(row, sampling, generated) -> torch.Tensor:
    count = counts_of(generated)
    return row[:DECODABLE] - sampling.frequency_penalty * count - sampling.presence_penalty * (count > 0).float()


def few_likely_ids() -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[[3, 10, 11]] = 8.0  # 3 and 5 are in the prompt too
    row[DECODABLE:] = 50.0
    return row


def test_torch_presence_and_frequency_see_only_generated_ids():
    sampling = Sampling(temperature=1.0, presence_penalty=0.3, frequency_penalty=0.2, seed=3)
    chooser = TokenChooser(sampling, [3, 3, 5], DECODABLE, CPU)
    row = few_likely_ids()
    generated = choices(chooser, [row] * 12)
    assert len(set(generated)) < len(generated)  # repeats, so counts differ from presence
    torch.testing.assert_close(chooser.scores(row), openai_penalized(row, sampling, generated))


# -- MLX: samplers


def mlx_choices(sampler, rows) -> list[int]:
    return [sampler(mx.array(row.numpy())[None]).item() for row in rows]


def test_mlx_greedy_sampler_is_shared_and_batched():
    assert greedy_sampler(DECODABLE) is greedy_sampler(DECODABLE)
    assert make_sampler(Sampling(), [1, 2], DECODABLE) is greedy_sampler(DECODABLE)
    assert isinstance(make_sampler(Sampling(repetition_penalty=1.2), [1], DECODABLE), SequenceSampler)
    rows = torch.stack([random_logits(i) for i in range(3)])
    got = greedy_sampler(DECODABLE)(mx.array(rows.numpy()))
    assert got.shape == (3,) and got.tolist() == rows[:, :DECODABLE].argmax(-1).tolist()


def test_mlx_seeds():
    rows = [random_logits(i) for i in range(20)]
    sampling = Sampling(temperature=1.5, seed=7, repetition_penalty=1.3, presence_penalty=0.5)
    first = mlx_choices(make_sampler(sampling, [1, 2], DECODABLE), rows)
    assert first == mlx_choices(make_sampler(sampling, [1, 2], DECODABLE), rows)
    other = Sampling(temperature=1.5, seed=8, repetition_penalty=1.3, presence_penalty=0.5)
    assert first != mlx_choices(make_sampler(other, [1, 2], DECODABLE), rows)
    # A fresh key each step: the same row does not give the same token every time.
    assert len(set(mlx_choices(make_sampler(Sampling(temperature=1.5, seed=7), [], DECODABLE), rows[:1] * 10))) > 1


def test_mlx_lazy_steps_equal_evaluated_steps():
    """BatchGenerator evaluates a step's choice only later: the history must chain lazily."""
    rows = [mx.array(random_logits(i).numpy())[None] for i in range(10)]
    sampling = Sampling(temperature=1.0, seed=5, repetition_penalty=1.5, frequency_penalty=0.5)
    stepwise = make_sampler(sampling, [1], DECODABLE)
    eager = [stepwise(row).item() for row in rows]
    sampler = make_sampler(sampling, [1], DECODABLE)
    lazy = [sampler(row) for row in rows]
    mx.eval(lazy)
    assert [t.item() for t in lazy] == eager


def test_mlx_choices_stay_in_the_kept_set():
    sampling = Sampling(temperature=1.5, top_k=5, top_p=0.9, seed=1)
    sampler = make_sampler(sampling, [], DECODABLE)
    for i in range(40):
        row = random_logits(i)
        kept = torch.isfinite(mlx_process(row, sampling, [], [])).nonzero().flatten().tolist()
        assert 1 < len(kept) <= 5
        assert mlx_choices(sampler, [row])[0] in kept


def test_mlx_top_k_1_is_the_processed_argmax():
    sampling = Sampling(temperature=1.0, top_k=1, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=BIAS)
    sampler = make_sampler(sampling, [3, 4], DECODABLE)
    row = mx.array(random_logits(0).numpy())[None]
    tokens = []
    for _ in range(6):
        expected = mx.argmax(sampler.scores(row), axis=-1).item()
        tokens.append(sampler(row).item())
        assert tokens[-1] == expected
    assert len(set(tokens)) > 1


def test_mlx_repetition_penalty_sees_the_prompt_and_the_choices():
    sampler = make_sampler(Sampling(repetition_penalty=2.0), [0], DECODABLE)
    assert mlx_choices(sampler, [staircase()] * 4) == [1, 2, 3, 4]


def test_mlx_presence_and_frequency_see_only_generated_ids():
    sampling = Sampling(temperature=1.0, presence_penalty=0.3, frequency_penalty=0.2, seed=3)
    sampler = make_sampler(sampling, [3, 3, 5], DECODABLE)
    row = few_likely_ids()
    generated = mlx_choices(sampler, [row] * 12)
    assert len(set(generated)) < len(generated)
    scores = torch.from_numpy(np.array(sampler.scores(mx.array(row.numpy())[None])[0]))
    torch.testing.assert_close(scores, openai_penalized(row, sampling, generated))


def test_mlx_repetition_penalty_acts_on_raw_logits_through_see_logits():
    """The sampler receives log-probabilities; wired in, see_logits gives it the logits, so the
    penalty decides as transformers (and Torch) do: seen 10 -> 7.7 loses to unseen 8."""
    logits = torch.full((VOCAB,), -10.0)
    logits[1], logits[2] = 10.0, 8.0
    sampling = Sampling(repetition_penalty=1.3)
    assert TokenChooser(sampling, [1], DECODABLE, CPU).choose(logits) == 2
    row = mx.array(logits.numpy())[None]
    logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
    sampler = make_sampler(sampling, [1], DECODABLE)
    (processor,) = mlx_sampling.logits_processors(sampler)
    assert sampler(processor(mx.array([1]), row) - mx.logsumexp(row, axis=-1, keepdims=True)).item() == 2
    # Without it the penalty acts on log-probabilities (-0.13 -> -0.17 still beats -2.1).
    assert make_sampler(sampling, [1], DECODABLE)(logprobs).item() == 1
    assert (
        mlx_sampling.logits_processors(make_sampler(Sampling(temperature=1.0, presence_penalty=1.0), [], DECODABLE))
        == []
    )
