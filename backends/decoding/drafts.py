"""Prompt-lookup (n-gram) drafts for speculative decoding, shared by both runtimes.

A sequence that repeats text it was given (an edit of a document, code that reuses its own
names, a quote) writes n-grams it has seen before. The draft is what followed the most recent
earlier occurrence of the text's last n-gram (the longest n that has one, from MAX_NGRAM down to
MIN_NGRAM), as vLLM's `ngram` method and llama.cpp's prompt lookup do. The decoder feeds the
draft to the model in one forward pass together with the sequence's next input and keeps the
longest prefix the model agrees with (`accepted` below, and each runtime's sampling module for
sampled rows), so the text is the same as without drafts: only the number of passes changes.

Pure Python, no runtime imports: the index is a dict per n-gram size, kept up to date a token at
a time, so a draft costs O(MAX_NGRAM) lookups however long the text is.
"""

from __future__ import annotations

from backends.contract import ModelLoadError, Sequence

# Draft tokens a step verifies by default where drafts pay: one sequence decoding on a CPU, whose
# step streams every weight for one token, so up to 3 more tokens in the same pass cost little. On
# CUDA a graphed step is cheaper than an eager verify pass: 0 (docs/decisions.md, D-draft-tokens).
DEFAULT_DRAFT_TOKENS = 3
MAX_DRAFT_TOKENS = 32  # a verify pass is a prefill of this many tokens at most


def applied_draft_tokens(requested: int, default: int) -> int:
    """PROMPT_LOOKUP_TOKENS as a runtime applies it: negative is its default (where drafts pay)."""
    if requested < 0:
        return default
    if requested > MAX_DRAFT_TOKENS:
        raise ModelLoadError(f"PROMPT_LOOKUP_TOKENS={requested}: at most {MAX_DRAFT_TOKENS} (0: off)")
    return requested


MAX_NGRAM = 3  # the longest n-gram looked up
# The shortest: one shared token alone (a space, a comma) predicts little, and a draft the model
# rejects costs a verify pass that is slower than a decode step (docs/decisions.md, D-draft-tokens).
MIN_NGRAM = 2


def speculates(sequence: Sequence) -> bool:
    """Whether a sequence may take drafts: its tokens are chosen from the raw logits alone
    (greedy, or sampled with temperature/top_k/top_p/min_p), it asked for no logprobs (a step then
    reports one token's), and a sampled one has no seed of its own (drafts are verified only while
    one sequence decodes, and a seed promises the same text in any batch)."""
    sampling = sequence.sampling
    return (
        sequence.logprobs is None
        and sequence.prompt_logprobs is None
        and not sampling.processed
        and (sampling.greedy or sampling.seed is None)
    )


class PromptLookup:
    """One sequence's text (prompt, then generated ids), its n-gram index, and how long its next
    draft may be: a verify pass costs more the more tokens it holds, so the length follows what
    the model accepts (transformers' assisted generation's schedule: 2 more after a draft kept
    whole, 1 fewer after a rejection, between 1 and `max_draft`)."""

    def __init__(self, prompt_ids: list[int], max_draft: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.max_draft = max_draft
        self.length = max_draft  # of the next draft
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.ids: list[int] = []
        # n -> {n-gram: where the token after its latest occurrence is}; an n-gram is indexed once
        # a token follows it, so the text's own last n-gram never matches itself.
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.extend(prompt_ids)
        self._prompt_length = len(prompt_ids)

    def catch_up(self, generated: list[int]) -> None:
        """The sequence's generated ids, all of them so far: those the text lacks join it."""
        self.extend(generated[len(self.ids) - self._prompt_length :])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.ids)  # the position `token` takes
            for n, index in self._after.items():
                if end >= n:
                    index[tuple(self.ids[end - n : end])] = end
            self.ids.append(token)

    def draft(self, left: int, vocabulary: int) -> list[int]:
        """The ids that followed the latest earlier occurrence of the text's last n-gram, longest
        n first, as many as the draft's length and `left` allow (`left`: tokens the sequence
        may still generate after the next one), up to the first id the model cannot generate
        (>= `vocabulary`); [] when none recurs."""
        limit = min(self.length, left)
        if limit <= 0:
            return []
        for n in self.sizes:
            if len(self.ids) < n:
                continue
            at = self._after[n].get(tuple(self.ids[-n:]))
            if at is not None:
                draft = self.ids[at : at + limit]
                return draft[: next((j for j, t in enumerate(draft) if t >= vocabulary), len(draft))]
        return []

    def verified(self, draft: list[int], tokens: list[int]) -> None:
        """A verify pass of `draft` gave `tokens`: they join the text, and the next draft's
        length follows whether the draft was kept whole."""
        if len(tokens) > len(draft):  # kept whole (and the model's next token after it)
            self.length = min(self.length + 2, self.max_draft)
        else:
            self.length = max(self.length - 1, 1)
        self.extend(tokens)


def accepted(draft: list[int], chosen: list[int]) -> list[int]:
    """Greedy verification: `chosen[j]` is the model's token after the inputs up to draft[j - 1]
    (chosen[0] after the sequence's own next input). The draft's ids are kept while they equal
    the model's, then the model's own token follows: between 1 and len(draft) + 1 tokens, the
    same as decoding them one at a time."""
    out = []
    for proposed, token in zip(draft, chosen, strict=False):
        out.append(token)
        if token != proposed:
            return out
    out.append(chosen[len(draft)])
    return out
