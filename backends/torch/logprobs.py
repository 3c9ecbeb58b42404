"""Log-probabilities of chosen tokens on PyTorch, shared by both Torch decoders.

The model's own distribution: log-softmax of the raw logits in float32 over the whole model
vocabulary (ids the tokenizer cannot decode included, as any other scorer of the model sees
them), whatever the sampling did to choose the token.
"""

from __future__ import annotations

import torch

from backends.contract import TokenLogprob


def token_logprobs(logits: torch.Tensor, chosen: list[int], top: int | list[int]) -> list[TokenLogprob]:
    """For each row of `logits` ([n, vocab]), the logprob of its chosen id and its `top` most
    likely ids (`top`: for all rows, or a count a row); one log-softmax and one top-k for all
    rows, one copy to the host."""
    tops = top if isinstance(top, list) else [top] * len(chosen)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(chosen, device=logprobs.device)[:, None])[:, 0].tolist()
    most = max(tops)
    alternatives = [[]] * len(chosen)
    if most > 0:
        values, ids = logprobs.topk(most, dim=-1)
        alternatives = [list(zip(i, v, strict=False)) for i, v in zip(ids.tolist(), values.tolist(), strict=False)]
    return [
        TokenLogprob(token, logprob, tuple(alt[:k]))
        for token, logprob, alt, k in zip(chosen, picked, alternatives, tops, strict=False)
    ]
