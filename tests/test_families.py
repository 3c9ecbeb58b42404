"""The batched Torch decoder on every family it serves (issue 26), on tiny checkpoints of each
(backends/torch/tiny.py TINY_FAMILIES: random weights, shapes that reach each family's own code).

For each family: its logits equal transformers' forward (float32, within 1e-5 of the logits'
scale) at every step, past its sliding window and longrope's switch; a sequence decodes the same
batched as alone; the prompt cache changes no output; an adapter equals the same adapter merged
into transformers' weights; int8 weights stay close; a schema-constrained output validates; and
the server batches it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from conftest import engine_of
from lora_reference import merge_lora_into_torch

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drive import drive
from backends.torch.decoder import BatchedDecoder
from backends.torch.tiny import TINY_FAMILIES, write_tiny_family

FAMILIES = sorted(TINY_FAMILIES)
PROMPT = [5 + (i * 37) % 580 for i in range(24)]


@pytest.fixture(scope="session")
def family_paths(tiny_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny_family(root / family, family, tiny_path) for family in FAMILIES}


@pytest.fixture(scope="session", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def family_backend(family, family_paths):
    return load_backend("torch", LoadOptions(model=str(family_paths[family]), dtype="float32", warmup=False))


def prompt_of(length: int) -> list[int]:
    return [5 + (i * 37) % 580 for i in range(length)]


def reference_steps(backend, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy ids and each step's logits from transformers' own forward, token by token with its
    cache (as its generation steps run)."""
    from transformers import DynamicCache

    model, decodable = backend.model, backend.undecodable_from
    cache = DynamicCache(config=model.config)
    ids, logits = [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        for _ in range(steps):
            row = out.logits[0, -1].float()
            logits.append(row)
            ids.append(int(row[:decodable].argmax()))
            position = len(prompt) + len(ids) - 1
            out = model(torch.tensor([[ids[-1]]]), cache=cache, use_cache=True, position_ids=torch.tensor([[position]]))
    return ids, logits


def test_every_family_takes_the_batched_decoder(family_backend):
    assert isinstance(family_backend.decoder(4), BatchedDecoder)


@pytest.mark.parametrize("length", [10, 40, 70], ids=["short", "past-windows", "past-longrope"])
def test_logits_equal_transformers_at_every_step(family_backend, length):
    """Windows of 16 and 32 and longrope's switch at 64 (TINY_FAMILIES) fall inside these."""
    prompt = prompt_of(length)
    expected_ids, expected_logits = reference_steps(family_backend, prompt, 30)
    weights = family_backend.decoder_weights
    first = BatchedDecoder(weights, 1).logits_after(prompt)
    scale = max(1.0, float(expected_logits[0].abs().max()))
    assert float((first - expected_logits[0]).abs().max()) <= 1e-5 * scale
    # Each decode step's logits, through the logprobs the decoder reports (log-softmax of them).
    got = drive(BatchedDecoder(weights, 1), [Sequence(1, prompt, Sampling(), 30, logprobs=5)])
    assert got.ids[1] == expected_ids
    for scores, logits in zip(got.logprobs[1], expected_logits, strict=False):
        reference = torch.log_softmax(logits, dim=-1)
        for token, logprob in (*scores.token.top, (scores.token.token, scores.token.logprob)):
            assert abs(logprob - float(reference[token])) <= 1e-5 * scale


def test_a_final_logit_cap_is_applied(family_paths, tiny_path, tmp_path):
    """Gemma 3's config may cap its logits (cap * tanh(logits / cap)); the published ones do not,
    so the tiny family has none, and this variant does."""
    path = write_tiny_family(tmp_path / "capped", "gemma3_text", tiny_path, final_logit_softcapping=3.0)
    backend = load_backend("torch", LoadOptions(model=str(path), dtype="float32", warmup=False))
    assert backend.decoder_weights.arch.logit_softcap == 3.0
    prompt = prompt_of(20)
    expected_ids, expected_logits = reference_steps(backend, prompt, 20)
    assert float(expected_logits[0].abs().max()) <= 3.0
    first = BatchedDecoder(backend.decoder_weights, 1).logits_after(prompt)
    assert float((first - expected_logits[0]).abs().max()) <= 1e-5
    assert (
        drive(BatchedDecoder(backend.decoder_weights, 1), [Sequence(1, prompt, Sampling(), 20)]).ids[1] == expected_ids
    )


def test_batched_equals_alone(family_backend, reach_groups):
    # 150 tokens: a row past 128 columns beside shorter ones, which attend in another group
    # (`_reach_groups`); windows and longrope's switch lie inside both.
    weights = family_backend.decoder_weights
    lengths = [3, 30, 17, 70, 9, 45, 150]
    sequences = [
        Sequence(i, prompt_of(n), Sampling() if i % 2 else Sampling(temperature=0.9, seed=i), 24 + 3 * i)
        for i, n in enumerate(lengths)
    ]
    together = drive(BatchedDecoder(weights, 4, prefill_chunk=16), sequences, arrive_at={4: 5, 5: 9, 6: 2}).ids
    assert any(found is not None for found in reach_groups)
    for sequence in sequences:
        assert together[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id], sequence.id


def record_padded_passes(monkeypatch) -> list[tuple[int, int]]:
    """The (rows, span) of every padded prefill pass (`_padded_pass`) from now on, as they run."""
    passes = []
    original = BatchedDecoder._padded_pass

    def recorded(self, rows, length, span):
        passes.append((rows, span))
        return original(self, rows, length, span)

    monkeypatch.setattr(BatchedDecoder, "_padded_pass", recorded)
    return passes


def test_new_prompts_padded_to_a_graphs_shape_compute_as_unpadded(family_backend, monkeypatch):
    """On CUDA new prompts are prefilled padded to a graph's shape (`_prefill_padded`: their tails
    and the group's spare rows write columns no query reads); here the same padded pass runs
    eagerly. Windows of 16 and 32 and longrope's switch at 64 send the longer prompts to the
    unpadded prefill, which must agree with it as well."""
    weights = family_backend.decoder_weights
    padded_passes = record_padded_passes(monkeypatch)  # (rows, span) of each
    for length in (3, 10, 16, 40):
        prompt = prompt_of(length)
        got = BatchedDecoder(weights, 1, prefill_graphs=True).logits_after(prompt)
        expected = BatchedDecoder(weights, 1).logits_after(prompt)
        assert float((got - expected).abs().max()) <= 1e-5 * max(1.0, float(expected.abs().max()))
    assert len(padded_passes) >= 3  # 3, 10 and 16 tokens fit every family's windows
    sequences = [Sequence(i, prompt_of(n), Sampling(), 20) for i, n in enumerate([3, 30, 10, 9, 45, 12])]
    padded_passes.clear()
    together = drive(BatchedDecoder(weights, 4, prefill_graphs=True), sequences, arrive_at={4: 3, 5: 3}).ids
    assert max(rows for rows, _ in padded_passes) >= 2  # prompts arriving together were padded into one group
    for sequence in sequences:
        assert together[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id], sequence.id


def test_pieces_after_cached_columns_padded_to_a_graphs_shape_compute_as_unpadded(family_backend, monkeypatch):
    """On CUDA a piece after cached columns (a long prompt's later chunks, a stored prefix's
    tail) is prefilled padded to a graph's shape too, its attention to the columns before it
    through a mask made from the positions (`_padded_pass` with a span); here the same padded
    pass runs eagerly. Sliding windows shorter than the span are masked in that pass; longrope's
    long prompts go to the unpadded prefill."""
    weights = family_backend.decoder_weights
    passes = record_padded_passes(monkeypatch)
    # Chunks of 16: prompts of 30-70 tokens are prefilled in 2-5 pieces, the later ones after
    # cached columns, while the others decode.
    sequences = [Sequence(i, prompt_of(n), Sampling(), 12) for i, n in enumerate([30, 70, 45, 9])]
    chunked = BatchedDecoder(weights, 4, prefill_graphs=True, prefill_chunk=16)
    together = drive(chunked, sequences, arrive_at={3: 4}).ids
    long_rope = chunked.long_prompts_from is not None
    assert any(span for _, span in passes) or long_rope
    for sequence in sequences:
        assert together[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id], sequence.id
    # A stored prefix's tail: prompts past what a new prompt's graph takes reuse a stored one.
    passes.clear()
    first = prompt_of(300)
    longer = first + prompt_of(340)[-25:]
    cached = BatchedDecoder(weights, 2, prefill_graphs=True, prompt_cache_bytes=1 << 24)
    drive(cached, [Sequence(1, first, Sampling(), 4)])
    with_cache = drive(cached, [Sequence(2, longer, Sampling(), 12)])
    assert with_cache.cached[2] >= 299
    assert any(span for _, span in passes) or long_rope
    assert with_cache.ids[2] == drive(BatchedDecoder(weights, 1), [Sequence(2, longer, Sampling(), 12)]).ids[2]


def test_the_prompt_cache_changes_no_output(family_backend):
    weights = family_backend.decoder_weights
    first, longer = prompt_of(40), prompt_of(40) + prompt_of(50)[-20:]
    cached = BatchedDecoder(weights, 2, prompt_cache_bytes=1 << 24)
    drive(cached, [Sequence(1, first, Sampling(), 12)])
    with_cache = drive(cached, [Sequence(2, longer, Sampling(), 20)])
    assert with_cache.cached[2] >= 39
    assert with_cache.ids[2] == drive(BatchedDecoder(weights, 2), [Sequence(2, longer, Sampling(), 20)]).ids[2]


def write_adapter(backend, directory: Path, rank: int = 4, scale: float = 2.0) -> Path:
    """An mlx-lm-format LoRA adapter on every Linear of the last block (mlx-lm's module names)."""
    from safetensors.torch import save_file

    from backends.files.adapters import block_count
    from backends.torch.lora import torch_linears

    last = block_count(backend.model) - 1
    generator = torch.Generator().manual_seed(7)
    tensors, keys = {}, set()
    for name, (n_in, n_out) in torch_linears(backend.model).items():
        if f".layers.{last}." in name:
            tensors[f"{name}.lora_a"] = torch.randn(n_in, rank, generator=generator) * 0.1
            tensors[f"{name}.lora_b"] = torch.randn(rank, n_out, generator=generator) * 0.1
            keys.add(name.split(f".{last}.", 1)[1])
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapters.safetensors"))
    config = {
        "fine_tune_type": "lora",
        "num_layers": 1,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": sorted(keys)},
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def test_an_adapter_equals_it_merged(family, family_paths, tmp_path):
    adapters = tmp_path / "adapters"
    backend = load_backend(
        "torch", LoadOptions(model=str(family_paths[family]), dtype="float32", adapters_dir=str(adapters), warmup=False)
    )
    write_adapter(backend, adapters / "every-linear")
    adapter = backend.adapters.get("every-linear")
    merged = load_backend("torch", LoadOptions(model=str(family_paths[family]), dtype="float32", warmup=False))
    assert merge_lora_into_torch(merged.model, adapters / "every-linear") == len(adapter.modules)
    # Two sequences of the adapter beside two of the base model, in one batch.
    sequences = [
        Sequence(i, prompt_of(12 + 5 * i), Sampling(), 20, adapter=adapter if i % 2 else None) for i in range(4)
    ]
    together = drive(BatchedDecoder(backend.decoder_weights, 4), sequences).ids
    for sequence in sequences:
        reference = merged if sequence.adapter else backend
        assert together[sequence.id] == reference_steps(reference, sequence.prompt_ids, 20)[0], sequence.id


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_compute_what_they_hold(family, family_paths, family_backend, method):
    """The quantized decoder against the same decoder over its weights dequantized (each matrix
    read back through its own kernel: linear(I) = W.T), so the check is of the fused layout and
    the kernels, not of how close 4 bits come; int8 also stays close to full precision."""
    import copy

    quantized = load_backend(
        "torch", LoadOptions(model=str(family_paths[family]), dtype="float32", quantize=method, warmup=False)
    )
    weights = quantized.decoder_weights
    dequantized = copy.copy(weights)
    dequantized.layers = [
        block._replace(
            **{
                name: getattr(block, name).linear(torch.eye(getattr(block, name).in_features)).t().contiguous()
                for name in block.matrices()
            }
        )
        for block in weights.layers
    ]
    decodable = weights.decodable
    got = BatchedDecoder(weights, 1).logits_after(PROMPT)[:decodable]
    held = BatchedDecoder(dequantized, 1).logits_after(PROMPT)[:decodable]
    if method == "int8":
        # int8pack multiplies a float32 model's activations in bfloat16 (torch_quant.Int8Weight:
        # its float32 kernel is slow), so the two differ by bfloat16's rounding (measured 1.1-1.8%
        # on the tiny families), not by a layout (which would be ~100%).
        assert float((got - held).norm() / held.norm()) < 0.05
    else:
        assert float((got - held).abs().max()) <= 1e-4 * max(1.0, float(held.abs().max()))
    if method == "int8":
        expected = BatchedDecoder(family_backend.decoder_weights, 1).logits_after(PROMPT)[:decodable]
        assert float((got - expected).norm() / expected.norm()) < 0.05
    sequences = [Sequence(i, prompt_of(8 + 5 * i), Sampling(), 12) for i in range(4)]
    together = drive(quantized.decoder(4), sequences).ids
    assert all(together[s.id] == drive(BatchedDecoder(weights, 1), [s]).ids[s.id] for s in sequences)


def test_a_schema_constrained_output_validates(family_backend):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    grammar = family_backend.constraint("json_schema", json.dumps(schema))
    eos = family_backend.eos_token_ids
    sequences = [
        Sequence(i, prompt_of(10 + i), Sampling(temperature=1.0, seed=i, constraint=grammar.matcher()), 60)
        for i in range(3)
    ]
    out = drive(BatchedDecoder(family_backend.decoder_weights, 3), sequences).ids
    for ids in out.values():
        if any(token in eos for token in ids):  # complete: everything before end-of-text is the document
            jsonschema.validate(
                json.loads(family_backend.decode(ids[: next(i for i, t in enumerate(ids) if t in eos)])), schema
            )


async def test_the_server_batches_a_family(make_client, family_backend):
    client = await make_client(lambda: family_backend, max_batch=4)
    bodies = [
        {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, "temperature": 0.8, "seed": i}
        for i in range(8)
    ]
    responses = await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
    assert [r.status for r in responses] == [200] * 8
    assert isinstance(engine_of(client)._decoder, BatchedDecoder)


def test_drive_keeps_to_the_decoders_adapter_slots(family_paths, tmp_path):
    """drive() admits as the engine does: with one adapter slot, a sequence of a second adapter
    waits until the first adapter's sequences are done, though the batch has room; and each
    sequence's ids are those it gets alone."""
    adapters = tmp_path / "adapters"
    path = family_paths["llama"]
    backend = load_backend(
        "torch", LoadOptions(model=str(path), dtype="float32", adapters_dir=str(adapters), warmup=False)
    )
    write_adapter(backend, adapters / "one")
    write_adapter(backend, adapters / "two", scale=3.0)
    one, two = backend.adapters.get("one"), backend.adapters.get("two")
    sequences = [Sequence(i, prompt_of(10 + i), Sampling(), 6, adapter=(one, one, two)[i]) for i in range(3)]
    decoder = BatchedDecoder(backend.decoder_weights, 3, adapter_slots=1)
    steps, added_at = [0], {}  # the step each sequence joined the batch at
    add = decoder.add

    def recording_add(sequence):
        added_at[sequence.id] = steps[0]
        return add(sequence)

    decoder.add = recording_add
    driven = drive(decoder, sequences, on_tokens=lambda step, tokens: steps.__setitem__(0, step + 1))
    assert added_at[0] == added_at[1] == 0  # the same adapter: together
    assert added_at[2] >= 6  # the second adapter waited for the first's sequences to finish
    for sequence in sequences:
        alone = drive(BatchedDecoder(backend.decoder_weights, 1), [sequence]).ids[sequence.id]
        assert driven.ids[sequence.id] == alone
