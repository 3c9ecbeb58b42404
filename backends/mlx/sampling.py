"""Choosing one sequence's next token on MLX: `Sampling`'s steps, as `backends.torch.sampling`
does them on PyTorch (tests/test_sampling.py holds both to transformers' own processors).

mlx-lm calls a sequence's sampler once per generated token with that row's log-probabilities
and evaluates the result asynchronously, a step later. So a sampler never reads its choice back
to Python: its history (counts of generated ids) and its PRNG key are mx arrays updated lazily
from the unevaluated choice, and each step's graph ends where the previous step's was evaluated.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_p

from backends.contract import Sampling

NEG_INF = float("-inf")


@functools.cache
def greedy_sampler(decodable: int) -> Callable[[mx.array], mx.array]:
    """Argmax over ids < `decodable` of logprobs [B, V]. One function object per `decodable`:
    BatchGenerator samples all rows that share a sampler object in one batched call."""

    def greedy(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs[:, :decodable], axis=-1)

    return greedy


def make_sampler(sampling: Sampling, prompt_ids: list[int], decodable: int) -> Callable[[mx.array], mx.array]:
    """A sequence's sampler: called once per generated token with logprobs [1, V] over the whole
    model vocabulary, it returns the chosen id, shape [1]. Plain greedy sequences share one."""
    if sampling.greedy and not sampling.processed:
        return greedy_sampler(decodable)
    return SequenceSampler(sampling, prompt_ids, decodable)


def logits_processors(sampler: Callable) -> list:
    """The mlx-lm logits processors that `sampler` needs beside it (none, or its `see_logits`)."""
    if isinstance(sampler, SequenceSampler) and sampler.sampling.repetition_penalty != 1.0:
        return [sampler.see_logits]
    return []


class SequenceSampler:
    """One sequence's sampler: its own PRNG key (split once per token, never MLX's global state,
    so a seed gives the same tokens whatever else is in the batch) and the history its
    penalties need."""

    def __init__(self, sampling: Sampling, prompt_ids: list[int], decodable: int):
        self.sampling = sampling
        self.decodable = decodable
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.key = None if sampling.greedy else mx.random.key(seed)
        repetition = sampling.repetition_penalty != 1.0
        self.counts = None  # float32 [decodable]: how often each id was generated
        if repetition or sampling.presence_penalty or sampling.frequency_penalty:
            self.counts = mx.zeros(decodable, dtype=mx.float32)
        self.prompt_seen = None  # bool [decodable]: the prompt's ids, which only the repetition penalty sees
        ids = [i for i in set(prompt_ids) if 0 <= i < decodable]
        if repetition and ids:
            self.prompt_seen = mx.zeros(decodable, dtype=mx.float32).at[mx.array(ids)].add(1.0) > 0
        self._logits = None  # this step's raw logits, when `see_logits` is wired in
        # A constraint's matcher must see each chosen token before it can mask the next step:
        # the one exception to never reading a choice back (that sequence's step then waits
        # for its previous token, which mlx-lm's pipelining would otherwise overlap).
        self.matcher = sampling.constraint
        self._unconsumed: mx.array | None = None

    def see_logits(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """A logits processor that changes nothing: it hands this step's raw logits to the sampler.

        The sampler itself receives log-probabilities, the logits less one constant. Every step
        but the repetition penalty is blind to that shift; the penalty is not (it divides a
        positive logit, multiplies a negative one), so without this processor it acts on the
        log-probabilities and barely touches a repeated likely token, unlike transformers'.
        """
        self._logits = logits
        return logits

    def scores(self, logprobs: mx.array) -> mx.array:
        """What the next choice is made from, given this sequence's history (see `process`)."""
        row = logprobs if self._logits is None else self._logits
        allowed = None
        if self.matcher is not None:
            if self._unconsumed is not None:
                self.matcher.consume(self._unconsumed.item())
                self._unconsumed = None
            allowed = mx.array(self.matcher.allowed()[: self.decodable])
        return process(row, self.sampling, self.decodable, self.prompt_seen, self.counts, allowed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        scores = self.scores(logprobs)
        self._logits = None  # never reused by a later step
        if self.sampling.greedy:
            token = mx.argmax(scores, axis=-1)
        else:
            self.key, subkey = mx.random.split(self.key)  # exactly one draw per token
            token = mx.random.categorical(scores, axis=-1, key=subkey)
        if self.counts is not None:
            self.counts = self.counts.at[token].add(1.0)
        if self.matcher is not None:
            self._unconsumed = token
        return token


def process(
    logits: mx.array,
    sampling: Sampling,
    decodable: int,
    prompt_seen: mx.array | None = None,
    counts: mx.array | None = None,
    allowed: mx.array | None = None,
) -> mx.array:
    """The float32 scores over ids < `decodable` (last axis) that a choice is made from, as
    `torch_sampling.process`: logit_bias, repetition penalty (ids of `prompt_seen` or with
    `counts` > 0), presence and frequency penalties (`counts`: how often each id was generated);
    when sampling, then the temperature, and -inf for the ids that top_k, top_p and min_p remove."""
    scores = logits[..., :decodable].astype(mx.float32)
    if allowed is not None:  # a constraint's mask first: bias and filters then choose among what it allows
        scores = mx.where(allowed, scores, NEG_INF)
    pairs = [(i, b) for i, b in sampling.logit_bias if 0 <= i < decodable]
    if pairs:
        ids, biases = zip(*pairs, strict=False)
        scores = scores + mx.zeros(decodable, dtype=mx.float32).at[mx.array(ids)].add(
            mx.array(biases, dtype=mx.float32)
        )
    penalty = sampling.repetition_penalty
    if penalty != 1.0:
        seen = prompt_seen
        if counts is not None:
            seen = counts > 0 if seen is None else seen | (counts > 0)
        if seen is not None:
            scores = mx.where(seen, mx.where(scores > 0, scores / penalty, scores * penalty), scores)
    if counts is not None and (sampling.presence_penalty or sampling.frequency_penalty):
        scores = scores - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0)
    if sampling.greedy:
        return scores
    scores = scores * sampling.scale
    if 0 < sampling.top_k < decodable:
        # Not mlx-lm's apply_top_k: it keeps exactly k of tied values and refuses k >= V;
        # transformers keeps every tie of the k-th value.
        kth = mx.topk(scores, sampling.top_k, axis=-1).min(axis=-1, keepdims=True)
        scores = mx.where(scores < kth, NEG_INF, scores)
    if sampling.top_p < 1.0:
        # mlx-lm's rule is ours (dropped once the strictly more likely tokens hold top_p of the
        # mass), but it exponentiates its input: normalized first, a large logit cannot overflow.
        scores = apply_top_p(scores - mx.logsumexp(scores, axis=-1, keepdims=True), sampling.top_p)
    if sampling.min_p > 0.0:
        scores = apply_min_p(scores, sampling.min_p)  # p < min_p * max p, in log space
    return scores
