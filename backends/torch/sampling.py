"""Choosing one sequence's next token on PyTorch, shared by both Torch decoders.

A leaf module (torch only): the generic decoder (`torch_runtime`) and the Phi fast path
(`torch_decoder`) both choose through it, so neither has to import the other for it. The steps
and their order are `Sampling`'s (transformers' `generate`); `backends.mlx.sampling` does the
same on MLX, and tests/test_sampling.py holds both to transformers' own processors.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from backends.contract import Sampling
from backends.decoding.drafts import accepted
from backends.decoding.grammar import advance_together


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
        self.matcher = sampling.constraint
        # Greedy under a constraint and nothing else: its token is the masked argmax
        # (the Phi fast path takes it on the device, for all such rows at once).
        self.constrained_greedy = (
            self.matcher is not None and sampling.greedy and not sampling.processed_besides_constraint
        )

    def scores(self, logits: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """What the next choice is made from, given this sequence's history (see `process`);
        `masked`: the caller applied its constraint's mask to `logits` already."""
        allowed = None
        if self.matcher is not None and not masked:
            allowed = unpack(self.matcher.allowed_words()[None], self.decodable, logits.device)[0]
        return process(logits, self.sampling, self.decodable, self.prompt_seen, self.counts, allowed)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from a 1-D row over the whole model vocabulary; recorded as generated
        (its matcher advanced too)."""
        token = int(self.pick(logits))
        self.record(token)
        return token

    def pick(self, logits: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """The next token as a 0-d tensor on the logits' device, not recorded: a batch reads all
        its rows' picks back at once (`choose_rows`), not with a wait each."""
        if self.plain:
            return torch.argmax(logits[: self.decodable])
        scores = self.scores(logits, masked)
        if self.sampling.greedy:
            return torch.argmax(scores)
        # One draw per token from the sequence's own generator: a seed gives the same tokens in any batch.
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)[0]

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
    return unpack_on_device(torch.from_numpy(words).to(device, non_blocking=True), decodable)


def unpack_on_device(packed: torch.Tensor, decodable: int) -> torch.Tensor:
    """Packed masks already on the device ([n, words] int32) as bools [n, decodable]."""
    bits = (packed[:, :, None] >> torch.arange(32, dtype=torch.int32, device=packed.device)) & 1
    return bits.reshape(len(packed), -1)[:, :decodable].bool()


def choose_rows(logits: torch.Tensor, choosers: list[TokenChooser]) -> list[int]:
    """The tokens of a batch's rows ([n, vocab] logits, a chooser each), chosen together and
    read back with one wait. Constrained rows get their masks in one copy and one masking; then
    their matchers advance, and fill their next masks, in one task."""
    decodable = choosers[0].decodable
    constrained = [r for r, chooser in enumerate(choosers) if chooser.matcher is not None]
    masked = {}
    if constrained:
        allowed = unpack(np.stack([choosers[r].matcher.allowed_words() for r in constrained]), decodable, logits.device)
        index = torch.tensor(constrained, device=logits.device)
        masked = dict(
            zip(constrained, logits[index, :decodable].float().masked_fill(~allowed, float("-inf")), strict=False)
        )
    picks = [
        chooser.pick(masked[r], masked=True) if r in masked else chooser.pick(logits[r])
        for r, chooser in enumerate(choosers)
    ]
    tokens = torch.stack(picks).tolist()
    for chooser, token in zip(choosers, tokens, strict=False):
        chooser.record(token, advance=False)
    if constrained:
        advance_together([choosers[r].matcher for r in constrained], [tokens[r] for r in constrained])
    return tokens


def sampled_on_device(sampling: Sampling) -> bool:
    """Sampling with temperature, top_k, top_p and min_p only (a grammar's mask allowed): the CUDA
    fast path draws these rows' tokens on the device, all in one batch, and chains their steps
    as it does greedy ones."""
    return not sampling.greedy and not sampling.processed_besides_constraint


def sample_on_device(
    logits, scale, top_k, top_p, min_p, seeds, offsets, kmax: int, use_top_p: bool, use_min_p: bool
) -> torch.Tensor:
    """One token per row of `logits` [n, decodable]: filtered as `process` filters one row
    (`filtered`; a row's top_k 0, top_p above 1 or min_p 0 is off), then drawn from the row's seed
    and offset (triton_ops.gumbel_argmax: the same seed and position give the same token in
    any batch). No host wait: every step is a batched device op; `kmax` and the flags say which
    filters any row uses."""
    from backends.torch.cuda.triton_ops import gumbel_argmax

    scores = filtered(
        logits.float(),
        scale[:, None],
        top_k=top_k[:, None] if kmax else None,
        top_p=top_p[:, None] if use_top_p else None,
        min_p=min_p[:, None] if use_min_p else None,
        kmax=kmax,
    )
    return gumbel_argmax(scores.contiguous(), seeds, offsets)


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
            ids, biases = zip(*pairs, strict=False)
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
    return filtered(scores, sampling.scale, **filters(sampling, decodable))


def filters(sampling: Sampling, decodable: int) -> dict:
    """A sequence's top_k, top_p and min_p as `filtered` takes them (None: off)."""
    return {
        "top_k": sampling.top_k if 0 < sampling.top_k < decodable else None,
        "top_p": sampling.top_p if sampling.top_p < 1.0 else None,
        "min_p": sampling.min_p if sampling.min_p > 0.0 else None,
    }


def verify_draft(logits: torch.Tensor, draft: list[int], chooser: TokenChooser) -> list[int]:
    """The tokens a verify pass yields: `logits` [len(draft) + 1, vocab], row j the model's after
    the sequence's next input and draft[:j] (`backends.decoding.drafts`). Only for sequences that
    `prompt_lookup.speculates` (nothing processed but the temperature and filters).

    Greedy: the draft while it equals the argmax, then the argmax. Sampled, the standard rule for
    a draft that is one certain token (Leviathan et al. 2023; Chen et al. 2023): draft[j] is kept
    with probability p_j(draft[j]); else a token drawn from p_j without draft[j], renormalized,
    ends the step; a draft kept whole is followed by a draw from the last row. Each token so
    follows p_j exactly, as one drawn a step would. Recorded as generated."""
    if chooser.sampling.greedy:
        tokens = accepted(draft, logits[:, : chooser.decodable].argmax(dim=-1).tolist())
    else:
        sampling, decodable = chooser.sampling, chooser.decodable
        scores = filtered(logits[:, :decodable].float(), sampling.scale, **filters(sampling, decodable))
        probs = torch.softmax(scores, dim=-1)
        n = len(draft)
        kept = probs[torch.arange(n, device=probs.device), torch.tensor(draft, device=probs.device)].tolist()
        uniform = torch.rand(n, generator=chooser.generator, device=probs.device).tolist()
        tokens = []
        for j, proposed in enumerate(draft):
            if uniform[j] < kept[j]:
                tokens.append(proposed)
                continue
            rest = probs[j].clone()
            rest[proposed] = 0.0  # rejected with probability 1 - p_j(proposed) > 0: some mass is left
            tokens.append(int(torch.multinomial(rest, 1, generator=chooser.generator)))
            break
        else:
            tokens.append(int(torch.multinomial(probs[n], 1, generator=chooser.generator)))
    for token in tokens:
        chooser.record(token)
    return tokens


def filtered(scores: torch.Tensor, scale, top_k=None, top_p=None, min_p=None, kmax: int = 0) -> torch.Tensor:
    """Scores [..., vocab] times the temperature's `scale`, then -inf for the ids that top_k,
    top_p and min_p remove (None: that filter is off). One row's settings are numbers; a batch's
    are tensors [n, 1], one value a row (a row's top_k 0: off; `kmax` the largest)."""
    scores = scores * scale
    if top_k is not None:
        if isinstance(top_k, int):
            kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
            drop = scores < kth
        else:
            kth = torch.topk(scores, kmax, dim=-1).values.gather(-1, top_k.clamp(1, kmax) - 1)
            drop = (top_k > 0) & (scores < kth)
        scores = scores.masked_fill(drop, float("-inf"))  # ties with the k-th stay, as in transformers
    if top_p is not None:
        # Dropped: a token once the tokens strictly more likely than it hold top_p of the mass.
        sorted_probs, order = torch.sort(torch.softmax(scores, dim=-1), dim=-1, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        outside[..., 0] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    if min_p is not None:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return scores


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A sequence's own random generator: its samples do not depend on what else runs."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator
