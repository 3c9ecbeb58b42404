"""Log-probabilities of chosen tokens on MLX, shared by both MLX decoders (see torch_logprobs:
the same definition, the model's own distribution over its whole vocabulary)."""

from __future__ import annotations

import mlx.core as mx

from backends.contract import TokenLogprob


def token_logprobs(logits: mx.array, chosen: list[int], top: int | list[int]) -> list[TokenLogprob]:
    """For each row of `logits` or log-probabilities ([n, vocab]), the logprob of its chosen id
    and its `top` most likely ids (`top`: for all rows, or a count a row), renormalized in float32."""
    tops = top if isinstance(top, list) else [top] * len(chosen)
    top = max(tops)
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, mx.array(chosen)[:, None], axis=-1)[:, 0]
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        values = mx.take_along_axis(logprobs, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)  # argpartition leaves the top ids unordered
        ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
        alternatives = [list(zip(i, v, strict=False)) for i, v in zip(ids.tolist(), values.tolist(), strict=False)]
    else:
        alternatives = [[]] * len(chosen)
    return [
        TokenLogprob(token, logprob, tuple(alt[:k]))
        for token, logprob, alt, k in zip(chosen, picked.tolist(), alternatives, tops, strict=False)
    ]
