"""Prompt-lookup drafts on MLX: one sequence decoded with its drafts verified
(backends.decoding.drafts), in place of mlx-lm's `generate_step`.

Each step feeds the sequence's next input and its draft to the model in one pass, keeps the
longest prefix the model agrees with (the same rule as `torch_sampling.verify_draft`) and trims
the cache of the rest with mlx-lm's `trim_prompt_cache`. A step without a draft is a plain decode
step. Only for sequences that `prompt_lookup.speculates`: greedy, or sampled with temperature,
top_k, top_p and min_p alone and no seed, so no sampler history is needed here.
"""

from __future__ import annotations

import secrets

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from backends.contract import Sampling, Sequence
from backends.decoding.drafts import PromptLookup, accepted
from backends.mlx.lora import Router, SlotBank
from backends.mlx.sampling import NEG_INF, process


class LookupGeneration:
    """One sequence's generation with prompt-lookup drafts: `step()` gives its next tokens."""

    def __init__(
        self,
        model,
        router: Router,
        bank: SlotBank,
        sequence: Sequence,
        cache: list,
        rest: list[int],
        offset: int,
        decodable: int,
        draft_tokens: int,
        prefill_step: int,
    ):
        self.model, self.router, self.bank = model, router, bank
        self.sequence = sequence
        self.cache = cache
        self.rest = rest  # prompt ids the cache lacks (at least the last, until the first token)
        self.offset = offset  # its adapter slot's, added to every id the model sees
        self.decodable = decodable
        self.prefill_step = prefill_step
        self.lookup = PromptLookup(sequence.prompt_ids, draft_tokens)
        self.next: int | None = None  # the input of the next step, once the prompt is in
        self.generated = 0
        sampling = sequence.sampling
        self._key = None if sampling.greedy else mx.random.key(secrets.randbits(63))  # speculates(): no seed

    def step(self) -> list[int]:
        """Its next tokens: none while its prompt is prefilled (`prefill_step` ids a step, so that
        a request arriving meanwhile waits for a chunk, not the whole prompt), then one or more."""
        with self.router.using(self.bank):
            if self.next is None:
                if len(self.rest) > self.prefill_step:
                    self.model(mx.array(self.rest[: self.prefill_step])[None] + self.offset, cache=self.cache)
                    mx.eval([c.state for c in self.cache])
                    self.rest = self.rest[self.prefill_step :]
                    return []
                tokens = [self._choose(self._forward(self.rest)[-1])]
                self.rest = []
                self.lookup.extend(tokens)
            else:
                draft = self.lookup.draft(self.sequence.max_new_tokens - self.generated - 1, self.decodable)
                logits = self._forward([self.next, *draft])
                if draft:
                    tokens = self._verify(logits, draft)
                    trim_prompt_cache(self.cache, len(draft) + 1 - len(tokens))
                    self.lookup.verified(draft, tokens)
                else:
                    tokens = [self._choose(logits[-1])]
                    self.lookup.extend(tokens)
        self.next = tokens[-1]
        self.generated += len(tokens)
        return tokens

    def _forward(self, ids: list[int]) -> mx.array:
        """The logits after each of `ids` ([len, vocab], float32), their KV added to the cache."""
        return self.model(mx.array(ids)[None] + self.offset, cache=self.cache)[0].astype(mx.float32)

    def _choose(self, logits: mx.array) -> int:
        scores = process(logits, self.sequence.sampling, self.decodable)
        if self._key is None:
            return int(mx.argmax(scores).item())
        token, self._key = draw(scores, self._key)
        return token

    def _verify(self, logits: mx.array, draft: list[int]) -> list[int]:
        tokens, self._key = verify_draft(logits, draft, self.sequence.sampling, self.decodable, self._key)
        return tokens


def draw(scores: mx.array, key: mx.array) -> tuple[int, mx.array]:
    """A token drawn from `scores` (unnormalized log-probabilities), and the key to use next."""
    key, subkey = mx.random.split(key)
    return int(mx.random.categorical(scores, key=subkey).item()), key


def verify_draft(
    logits: mx.array, draft: list[int], sampling: Sampling, decodable: int, key: mx.array | None
) -> tuple[list[int], mx.array | None]:
    """The tokens of a verify pass (`logits` [len(draft) + 1, vocab]) and the key to use next, by
    `torch_sampling.verify_draft`'s rule: greedy (`key` None), the draft while it equals the
    argmax, then the argmax; sampled, draft[j] is kept with probability p_j(draft[j]), else a draw
    from p_j without it ends the step, and a draft kept whole is followed by a draw from the last
    row, so each token follows p_j exactly."""
    scores = process(logits, sampling, decodable)  # [len(draft) + 1, decodable]
    if key is None:
        return accepted(draft, mx.argmax(scores, axis=-1).tolist()), None
    n = len(draft)
    kept = mx.softmax(scores, axis=-1)[mx.arange(n), mx.array(draft)].tolist()
    key, subkey = mx.random.split(key)
    uniform = mx.random.uniform(shape=(n,), key=subkey).tolist()
    tokens = []
    for j, proposed in enumerate(draft):
        if uniform[j] < kept[j]:
            tokens.append(proposed)
            continue
        without = mx.where(mx.arange(decodable) == proposed, NEG_INF, scores[j])  # categorical renormalizes
        token, key = draw(without, key)
        return [*tokens, token], key
    token, key = draw(scores[n], key)
    return [*tokens, token], key
