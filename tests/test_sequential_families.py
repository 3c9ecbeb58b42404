"""The families the batched Torch decoder does not describe yet, served one sequence at a time
through transformers' forward (backends/torch/tiny.py SEQUENTIAL_FAMILIES; MLX batches them,
tests/test_mlx_families.py): Gemma 4's text model (per-layer embeddings, KV shared across layers,
wider global heads). Its replies equal transformers' greedy ones, alone and through the engine's
queue beside others.
"""

from __future__ import annotations

import pytest
from test_families import prompt_of, reference_steps

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drive import drive
from backends.torch.runtime import SingleSequenceDecoder
from backends.torch.tiny import SEQUENTIAL_FAMILIES, write_tiny_family


@pytest.fixture(scope="module", params=sorted(SEQUENTIAL_FAMILIES))
def sequential(request, tiny_path, tmp_path_factory):
    path = write_tiny_family(tmp_path_factory.mktemp("sequential") / request.param, request.param, tiny_path)
    return load_backend("torch", LoadOptions(model=str(path), dtype="float32", warmup=False))


def greedy_reference(backend, prompt: list[int], steps: int) -> list[int]:
    return reference_steps(backend, prompt, steps)[0]


def test_it_is_served_one_sequence_at_a_time_as_transformers_computes(sequential):
    assert isinstance(sequential.decoder(4), SingleSequenceDecoder)
    sequences = [Sequence(i, prompt_of(n), Sampling(), 20) for i, n in enumerate([40, 9, 17])]
    got = drive(sequential.decoder(4), sequences, arrive_at={2: 3}).ids
    for sequence in sequences:
        assert got[sequence.id] == greedy_reference(sequential, sequence.prompt_ids, 20), sequence.id
