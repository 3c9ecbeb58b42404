"""bench.py --perplexity scores what it says (benchmarks/perplexity.py): on the tiny model, each
runtime's perplexity is exp of the mean negative log-likelihood that transformers' own forward
gives the second half of each whole window (llama-perplexity's method), BOS in place of each
window's first id when the file asks for one."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.torch.tiny import ascii_lines
from benchmarks.perplexity import mlx_scorer, perplexity, torch_scorer

CONTEXT = 32
SCORERS = {"torch": torch_scorer, "mlx": mlx_scorer}


def reference(model, ids: list[int], bos: int | None) -> tuple[float, int]:
    """exp(mean NLL) of ids from position CONTEXT/2 + 1 of each whole window, written out plainly."""
    nll = []
    for start in range(0, len(ids) - CONTEXT + 1, CONTEXT):
        window = torch.tensor(ids[start : start + CONTEXT])
        if bos is not None:
            window[0] = bos
        with torch.no_grad():
            logprobs = torch.log_softmax(model(window[None]).logits[0].float(), dim=-1)
        half = CONTEXT // 2
        nll += (-logprobs[half:-1].gather(1, window[half + 1 :, None])[:, 0]).tolist()
    return math.exp(sum(nll) / len(nll)), len(nll)


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
@pytest.mark.parametrize("bos", [None, 0])
def test_perplexity_is_exp_mean_nll_of_each_windows_second_half(request, tiny_path, runtime, bos):
    backend = request.getfixturevalue(f"{runtime}_backend")
    ids = backend.encode(" ".join(ascii_lines()))[: 5 * CONTEXT + 7]  # a partial window at the end: left out
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    expected, scored = reference(model, ids, bos)

    measured = perplexity(SCORERS[runtime](backend), ids, CONTEXT, bos)

    assert scored == 5 * (CONTEXT // 2 - 1)
    assert (measured["tokens"], measured["windows"]) == (scored, 5)
    assert measured["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert 1 < measured["perplexity"] < backend.vocab_size
