"""Choosing one sequence's next token on PyTorch, shared by both Torch decoders.

A leaf module (torch only): the generic decoder (`torch_runtime`) and the Phi fast path
(`torch_fast`) both choose through it, so neither has to import the other for it. The steps
and their order are `Sampling`'s (transformers' `generate`); `backends.mlx_sampling` does the
same on MLX, and tests/test_sampling.py holds both to transformers' own processors.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from backends import Sampling
from backends.grammar import advance_together


class TokenChooser:
    """One sequence's token choice: holds its generator and the history its penalties need.

    `plain` sequences (greedy, nothing processed) hold no tensors and draw nothing: the caller
    may take `argmax(logits[:decodable])` itself (batched on the device), then `record` it.
    """

    def __init__(self, sampling: Sampling, prompt_ids: list[int], decodable: int, device: torch.device):
        self.sampling = sampling
        self.decodable = decodable  # the model's vocabulary may be larger: ids from here on are never chosen
        self.plain = sampling.greedy and not sampling.processed
        self.generator = None if sampling.greedy else seeded_generator(sampling.seed, device)
        repetition = sampling.repetition_penalty != 1.0
        self.counts = None  # float32 [decodable]: how often each id was generated
        if repetition or sampling.presence_penalty or sampling.frequency_penalty:
            self.counts = torch.zeros(decodable, dtype=torch.float32, device=device)
        self.prompt_seen = None  # bool [decodable]: the prompt's ids, which only the repetition penalty sees
        if repetition:
            self.prompt_seen = torch.zeros(decodable, dtype=torch.bool, device=device)
            ids = [i for i in set(prompt_ids) if 0 <= i < decodable]
            if ids:
                self.prompt_seen[torch.tensor(ids, device=device)] = True
        self.matcher = sampling.constraint.matcher() if sampling.constraint is not None else None
        # Greedy under a constraint and nothing else: its token is the masked argmax
        # (`choose_constrained` takes those of all such rows at once).
        self.constrained_greedy = self.matcher is not None and sampling.greedy and not sampling.processed_besides_constraint

    def scores(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """What the next choice is made from, given this sequence's history (see `process`);
        `allowed`: its constraint's mask, when the caller unpacked it with other rows'."""
        if self.matcher is not None and allowed is None:
            allowed = unpack(self.matcher.allowed_words()[None], self.decodable, logits.device)[0]
        return process(logits, self.sampling, self.decodable, self.prompt_seen, self.counts, allowed)

    def choose(self, logits: torch.Tensor, allowed: torch.Tensor | None = None, advance: bool = True) -> int:
        """The next token from a 1-D row over the whole model vocabulary; recorded as generated
        (its matcher advanced too, unless the caller advances the rows together)."""
        if self.plain:
            token = int(torch.argmax(logits[: self.decodable]))
        else:
            token = _choose(self.scores(logits, allowed), self.sampling, self.generator)
        self.record(token, advance)
        return token

    def record(self, token: int, advance: bool = True) -> None:
        """A token chosen (here or by the caller, on the device): the penalties see it from now
        on, and its matcher moves past it unless the caller advances the rows together."""
        if self.counts is not None and 0 <= token < self.decodable:
            self.counts[token] += 1
        if self.matcher is not None and advance:
            self.matcher.consume(token)


def unpack(words: np.ndarray, decodable: int, device: torch.device) -> torch.Tensor:
    """Packed masks ([n, words] int32, a bit an id) as bools [n, decodable], unpacked on the
    device: an eighth of the bytes to copy."""
    packed = torch.from_numpy(words).to(device, non_blocking=True)
    bits = (packed[:, :, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    return bits.reshape(len(words), -1)[:, :decodable].bool()


def choose_constrained(logits: torch.Tensor, choosers: list[TokenChooser]) -> list[int]:
    """The tokens of constrained rows ([n, vocab] logits, a chooser each), chosen together: one
    mask copy for all, one argmax for the greedy ones (the others sample each with its own
    generator); then their matchers advance, and fill their next masks, in one task."""
    decodable = choosers[0].decodable
    allowed = unpack(np.stack([chooser.matcher.allowed_words() for chooser in choosers]), decodable, logits.device)
    greedy = logits[:, :decodable].masked_fill(~allowed, float("-inf")).argmax(dim=-1).tolist()
    tokens = []
    for chooser, row, mask, token in zip(choosers, logits, allowed, greedy):
        if chooser.constrained_greedy:
            chooser.record(token, advance=False)
        else:
            token = chooser.choose(row, mask, advance=False)
        tokens.append(token)
    advance_together([chooser.matcher for chooser in choosers], tokens)
    return tokens


def process(
    logits: torch.Tensor,
    sampling: Sampling,
    decodable: int,
    prompt_seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 scores over ids < `decodable` that a choice is made from, in `Sampling`'s order:
    -inf for the ids a constraint does not allow (`allowed`: bool per id), logit_bias,
    repetition penalty (ids of `prompt_seen` or with `counts` > 0), presence and frequency
    penalties (`counts`: how often each id was generated); when sampling, then the temperature,
    and -inf for the ids that top_k, top_p and min_p remove. Never changes `logits`."""
    scores = logits[:decodable].to(torch.float32)  # ops below are out of place: this may be a view
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sampling.logit_bias:
        pairs = [(i, b) for i, b in sampling.logit_bias if 0 <= i < decodable]
        if pairs:
            ids, biases = zip(*pairs)
            ids_t = torch.tensor(ids, device=scores.device)
            scores = scores.index_add(0, ids_t, torch.tensor(biases, dtype=torch.float32, device=scores.device))
    penalty = sampling.repetition_penalty
    if penalty != 1.0:
        seen = prompt_seen
        if counts is not None:
            seen = counts > 0 if seen is None else seen | (counts > 0)
        if seen is not None:
            scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    if counts is not None and (sampling.presence_penalty or sampling.frequency_penalty):
        scores = scores - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0)
    if sampling.greedy:
        return scores
    scores = scores * sampling.scale
    if 0 < sampling.top_k < decodable:
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th stay, as in transformers
    if sampling.top_p < 1.0:
        # Dropped: a token once the tokens strictly more likely than it hold top_p of the mass.
        sorted_probs, order = torch.sort(torch.softmax(scores, dim=-1), descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p
        outside[0] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    if sampling.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < sampling.min_p * probs.max(), float("-inf"))
    return scores


def _choose(scores: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(torch.argmax(scores))
    # One draw per token from the sequence's own generator: a seed gives the same tokens in any batch.
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A sequence's own random generator: its samples do not depend on what else runs."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator
