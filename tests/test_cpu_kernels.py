"""The CPU's own kernels (backends/torch/cpu/kernels.cpp) and llama.cpp's block types (backends/torch/quant/blocks.py).

Checked against the GGUF format's own reference code (gguf-py's numpy quantizer and
dequantizer) and against transformers: blocks are written byte for byte as llama.cpp's
reference quantizer writes them; a product is the dot of the weight's blocks with the
activations quantized to int8 blocks (llama.cpp's Q8 activations); the compiled step of every
family the decoder serves computes what transformers computes, prompt and decode, batched or alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_families import FAMILIES, PROMPT, prompt_of, reference_steps

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drafts import PromptLookup
from backends.decoding.drive import drive
from backends.torch.cpu.kernels import kernels
from backends.torch.cpu.step import decode_step
from backends.torch.decoder import PROMPT_TILES_FROM, BatchedDecoder
from backends.torch.network import Network
from backends.torch.quant.blocks import KINDS, BlockWeight, StackedBlocks
from backends.torch.tiny import write_tiny_family

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = sorted(KINDS)


def weights(out: int = 96, width: int = 320, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(out, width, generator=generator)
    w[3] = 0.0  # a zero row: scale 0, no division by it
    w[5, :32] = 1.5  # a constant block
    return w


@pytest.mark.parametrize("name", TYPES)
def test_blocks_are_written_as_llama_cpps_reference_writes_them(name):
    w = weights()
    ours = BlockWeight.quantize(w, name).raw.numpy()
    theirs = quantize(w.numpy(), GGMLQuantizationType[name.upper()])
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("name", TYPES)
def test_dequantized_blocks_are_the_formats_values(name):
    block = BlockWeight.quantize(weights(), name)
    expected = dequantize(block.raw.numpy(), GGMLQuantizationType[name.upper()])
    assert torch.equal(block.dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("rows", [1, 3, 4, 70])
@pytest.mark.parametrize("name", TYPES)
def test_a_product_is_the_blocks_times_int8_activations(name, rows):
    """x's rows quantized to Q8_0 blocks (as llama.cpp's dot products take them), times the
    dequantized weight, in float64: what the kernel computes, up to float32 sums. Rows past a
    tile of 64, a remainder past groups of 4 and (where AMX is granted) tiles of 16 padded are
    covered."""
    block = BlockWeight.quantize(weights(), name)
    x = torch.randn(rows, block.in_features, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # an all-zero activation block
    x_q8 = dequantize(quantize(x.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    # gguf-py keeps the activation scale in float16; the kernel keeps it in float32, as llama.cpp's
    # Q8_1 does for its sum: compare with the float16 rounding's tolerance.
    expected = torch.from_numpy(x_q8).double() @ block.dequantize().double().t()
    got = block.linear(x)
    assert got.shape == (rows, block.out_features)
    assert float((got.double() - expected).norm() / expected.norm()) < 2e-3
    # the same rows alone, or in any company, come out alike
    assert torch.equal(block.linear(x[-1:]), got[-1:])
    # sixteen rows interleaved (as served): the same products, and the rows as stored come back
    raw = block.raw
    block.pack()
    assert block.packed is not None and block.raw is None and torch.equal(block.rows(), raw)
    packed = block.linear(x)
    assert float((packed.double() - expected).norm() / expected.norm()) < 2e-3
    assert float((packed - got).abs().max()) <= 1e-4 * float(got.abs().max())
    assert torch.equal(block.linear(x[-1:]), packed[-1:])
    assert torch.equal(
        block.dequantize(), torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[name.upper()]))
    )


@pytest.mark.parametrize("name", TYPES)
def test_a_prompts_rows_are_bfloat16_tile_products_row_by_row(name):
    """Where the CPU has AMX-BF16 tiles: a prompt's rows (from `prompt_from` on) are the weight's
    values rounded to bfloat16 times the activations rounded to bfloat16, summed in float32;
    the rows before it (decode rows) stay the exact int8 products; a row comes out the same
    bits alone, in any company, or after exact rows. 48 outputs: an odd count of 16-row groups;
    70 rows: row tiles of 32 with padding."""
    if not kernels().prompt_tiles():
        pytest.skip("no AMX-BF16 tiles on this CPU (or Linux does not grant them)")
    mm = kernels().mm
    block = BlockWeight.quantize(weights(48), name)
    rounded = block.dequantize().bfloat16().double()
    block.pack()
    operand = (*block.operand, block.in_features)
    x = torch.randn(70, block.in_features, generator=torch.Generator().manual_seed(3))
    x[0, :32] = 0.0
    exact = mm(x, *operand)
    tiles = mm(x, *operand, prompt_from=0)
    expected = x.bfloat16().double() @ rounded.t()
    assert float((tiles.double() - expected).norm() / expected.norm()) < 1e-6  # float32 sums of exact products
    assert not torch.equal(tiles, exact)  # the rows did take another path
    assert torch.equal(mm(x, *operand, prompt_from=len(x)), exact)
    mixed = mm(x, *operand, prompt_from=5)
    assert torch.equal(mixed[:5], exact[:5]) and torch.equal(mixed[5:], tiles[5:])
    for rows in (slice(69, 70), slice(0, 1), slice(10, 43)):
        assert torch.equal(mm(x[rows], *operand, prompt_from=0), tiles[rows])


def test_rows_stack_and_columns_join_by_their_bytes():
    a, b = BlockWeight.quantize(weights(64, 128, 1), "q4_1"), BlockWeight.quantize(weights(32, 128, 2), "q4_1")
    stacked = BlockWeight.stack_rows([a, b])
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = BlockWeight.quantize(weights(64, 64, 3), "q4_1")
    joined = BlockWeight.join_columns([a, c])
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), c.dequantize()], dim=1))
    other = BlockWeight.quantize(weights(32, 128), "q8_0")
    mixed = BlockWeight.stack_rows([a, other])  # of two types: a product each, side by side
    assert isinstance(mixed, StackedBlocks) and mixed.out_features == 96
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), other.dequantize()]))
    x = torch.randn(3, 128)
    assert torch.equal(mixed.linear(x), torch.cat([a.linear(x), other.linear(x)], dim=1))
    with pytest.raises(ValueError, match="different block types"):
        BlockWeight.join_columns([a, BlockWeight.quantize(weights(64, 128), "q8_0")])


def test_a_width_that_is_not_whole_blocks_is_refused():
    from backends.contract import ModelLoadError

    with pytest.raises(ModelLoadError, match="multiples of 32"):
        BlockWeight.quantize(torch.randn(8, 40), "q8_0")


@pytest.fixture(scope="module")
def family_paths(tiny_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny_family(root / family, family, tiny_path) for family in FAMILIES}


@pytest.fixture(scope="module", params=[*FAMILIES, "phi"])
def float_family(request, family_paths, tiny_path):
    path = tiny_path if request.param == "phi" else family_paths[request.param]  # phi: gelu_new, partial rotary
    return load_backend("torch", LoadOptions(model=str(path), dtype="float32", warmup=False))


def compiled(weights, rows: int, **kwargs) -> BatchedDecoder:
    """A decoder whose passes run the compiled step, here over float32 matrices (which serve on
    torch's operators by default): so its sums meet transformers' within float32's rounding."""
    decoder = BatchedDecoder(weights, rows, **kwargs)
    decoder.network.cpu_step = decode_step(weights, decoder.kv, decoder.network.tables)
    assert decoder.network.cpu_step is not None
    return decoder


@pytest.fixture(params=["native", "x86-64-v3"], ids=["native", "avx2"])
def simd_target(request, monkeypatch):
    """The kernels of this machine, then those built for AVX2 without AVX-512 (Lanes8, exp8):
    the step's own code differs by target, so each is checked against transformers."""
    import platform

    import backends.torch.cpu.kernels as cpu

    if request.param != "native":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("x86 targets")
        monkeypatch.setattr(cpu, "_module", cpu.variant(request.param))
    return cpu.kernels().simd()


@pytest.mark.parametrize("length", [10, 40, 70], ids=["short", "past-windows", "past-longrope"])
def test_the_compiled_step_computes_what_transformers_computes(float_family, length, simd_target):
    """Every family: the prompt's logits and each decode step's, against transformers' forward.
    Windows of 16 and 32 and longrope's switch at 64 (backends/torch/tiny.py) fall inside these."""
    prompt = prompt_of(length)
    expected_ids, expected_logits = reference_steps(float_family, prompt, 24)
    weights = float_family.decoder_weights
    scale = max(1.0, float(expected_logits[0].abs().max()))
    first = compiled(weights, 1).logits_after(prompt)
    assert float((first - expected_logits[0]).abs().max()) <= 1e-4 * scale
    got = drive(compiled(weights, 1), [Sequence(1, prompt, Sampling(), 24, logprobs=5)])
    assert got.ids[1] == expected_ids
    for scores, logits in zip(got.logprobs[1], expected_logits, strict=False):
        reference = torch.log_softmax(logits, dim=-1)
        for token, logprob in (*scores.token.top, (scores.token.token, scores.token.logprob)):
            assert abs(logprob - float(reference[token])) <= 1e-4 * scale


@pytest.mark.parametrize("method", TYPES)
def test_block_weights_serve_batched_as_alone(family_paths, method, simd_target):
    """Quantized to each block type (the families' widths are whole blocks), a sequence decodes
    the same ids batched with others, arriving at other times, as alone: each token's output
    depends on its own row only."""
    backend = load_backend(
        "torch", LoadOptions(model=str(family_paths["llama"]), dtype="float32", quantize=method, warmup=False)
    )
    assert backend.info.quantization["method"] == "ggml-blocks"
    weights = backend.decoder_weights
    sequences = [
        Sequence(i, prompt_of(n), Sampling() if i % 2 else Sampling(temperature=0.9, seed=i), 16 + 3 * i)
        for i, n in enumerate([3, 30, 17, 70, 9])
    ]
    decoder = BatchedDecoder(weights, 4, prefill_chunk=16)
    assert decoder.network.cpu_step is not None
    together = drive(decoder, sequences, arrive_at={3: 5, 4: 2}).ids
    for sequence in sequences:
        assert together[sequence.id] == drive(BatchedDecoder(weights, 1), [sequence]).ids[sequence.id]


def test_a_fused_matrix_of_two_block_types_runs_in_the_compiled_step(family_paths, simd_target):
    """A Q4_K_M file's q and k are Q4_K, its v Q6_K: their fused matrix is a product a type
    (StackedBlocks, the step's Linear::parts). The compiled step gives what the products one by
    one (torch's operators between them) give, and runs of one type stay one matrix."""
    backend = load_backend(
        "torch", LoadOptions(model=str(family_paths["llama"]), dtype="float32", quantize="q8_0", warmup=False)
    )
    weights = backend.decoder_weights
    block = weights.layers[0]
    raw, width, q_rows = block.w_in.rows(), block.w_in.in_features, weights.heads * weights.head_dim
    q8 = KINDS["q8_0"]
    kv = BlockWeight.quantize(BlockWeight(raw[q_rows:], q8, width).dequantize(), "q4_1")
    halves = [BlockWeight(raw[: q_rows // 2], q8, width), BlockWeight(raw[q_rows // 2 : q_rows], q8, width)]
    stacked = BlockWeight.stack_rows([*halves, kv])
    assert isinstance(stacked, StackedBlocks) and [p.name for p in stacked.parts] == ["q8_0", "q4_1"]
    assert stacked.out_features == block.w_in.out_features
    weights.layers[0] = block._replace(w_in=stacked)
    compiled = BatchedDecoder(weights, 1)
    assert compiled.network.cpu_step is not None
    # The per-row path: a prompt's bfloat16 attention (AMX) would be this check's error.
    compiled.network.prompt_tiles = lambda i: False
    operators = BatchedDecoder(weights, 1)
    operators.network.cpu_step = None
    got, expected = compiled.logits_after(PROMPT), operators.logits_after(PROMPT)
    assert float((got - expected).norm() / expected.norm()) < 1e-4


def wide_window_checkpoint(path, tokenizer_from, head_dim: int = 32):
    """A Mistral of `head_dim` (32: the attention tiles' unit; 80: Phi-2's, padded to 96) with a
    sliding window of 24: random weights, the tiny tokenizer."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    eos = tokenizer.eos_token_id
    config = MistralConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, sliding_window=24, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=eos, eos_token_id=eos, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(7)
    MistralForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("head_dim", [32, 80])
def test_a_prompts_attention_takes_the_tiles_row_by_row(tiny_path, tmp_path, head_dim):
    """Where the CPU has AMX-BF16 tiles, a long prompt's tokens attend in them too (cpu_step.h,
    `attend_tiles`: query, keys and values rounded to bfloat16, the softmax in float32). A
    token's output still depends on its own row and its sequence's columns only: the same bits
    whatever the pieces' size, the company, the window (24 columns here, crossed by the
    prompt), and close to float32's."""
    if not kernels().prompt_tiles():
        pytest.skip("no AMX-BF16 tiles on this CPU (or Linux does not grant them)")
    path = wide_window_checkpoint(tmp_path / "wide", tiny_path, head_dim)
    weights = load_backend(
        "torch", LoadOptions(model=str(path), dtype="float32", quantize="q8_0", warmup=False)
    ).decoder_weights
    long = prompt_of(90)
    sequence = Sequence(1, long, Sampling(), 6, logprobs=5)

    def scores(driven):
        return [(s.token.token, s.token.logprob, s.token.top) for s in driven.logprobs[1]]

    alone = drive(BatchedDecoder(weights, 1, prefill_chunk=256), [sequence])
    for chunk in (16, 37):
        company = [sequence, Sequence(2, prompt_of(50), Sampling(), 30), Sequence(3, prompt_of(70), Sampling(), 5)]
        together = drive(BatchedDecoder(weights, 4, prefill_chunk=chunk), company, arrive_at={1: 3})
        assert together.ids[1] == alone.ids[1]
        assert scores(together) == scores(alone)
    floats = load_backend("torch", LoadOptions(model=str(path), dtype="float32", warmup=False)).decoder_weights
    got = BatchedDecoder(weights, 1).logits_after(long)
    expected = BatchedDecoder(floats, 1).logits_after(long)
    # Measured 9.4% at 90 tokens; 9.6% on the exact int8 path without tiles (PHI2_CPU_AMX=0), 8.0%
    # with the products' tiles alone: Q8_0 on these random weights. Wrong columns would be ~100%.
    assert float((got - expected).norm() / expected.norm()) < 0.15


@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_a_prompts_attention_in_tiles_is_the_rows_own(tiny_path, tmp_path, head_dim, simd_target, monkeypatch):
    """Without AMX, a long prompt's tokens attend in float32 tiles of 32 queries (step.h,
    `attend_tile`: a block of columns read once for the tile, the softmax online; the native and
    the AVX2 builds): a token's output is the same bits whatever the pieces' size, the company,
    the window (24 columns, crossed), and close to the per-row path's (PROMPT_TILES_FROM out of
    reach)."""
    from backends.torch import decoder as torch_decoder

    if kernels().prompt_tiles():
        pytest.skip("AMX-BF16 tiles take these rows here")
    path = wide_window_checkpoint(tmp_path / "wide", tiny_path, head_dim)
    weights = load_backend(
        "torch", LoadOptions(model=str(path), dtype="float32", quantize="q8_0", warmup=False)
    ).decoder_weights
    long = prompt_of(150)
    sequence = Sequence(1, long, Sampling(), 6, logprobs=5)

    def scores(driven):
        return [(s.token.token, s.token.logprob, s.token.top) for s in driven.logprobs[1]]

    alone = drive(BatchedDecoder(weights, 1, prefill_chunk=256), [sequence])
    for chunk in (16, 37):
        company = [sequence, Sequence(2, prompt_of(50), Sampling(), 30), Sequence(3, prompt_of(70), Sampling(), 5)]
        together = drive(BatchedDecoder(weights, 4, prefill_chunk=chunk), company, arrive_at={1: 3})
        assert together.ids[1] == alone.ids[1]
        assert scores(together) == scores(alone)
    tiled = BatchedDecoder(weights, 1).logits_after(long, every_position=True)
    exact = BatchedDecoder(weights, 1)
    exact.network.prompt_tiles = lambda i: False  # every position through the per-row path
    per_row = exact.logits_after(long, every_position=True)
    # float32 tiles: most positions within float32's rounding, but a difference that small can
    # move one of the next product's int8 activations across a step: 0.4-0.7% of the logits'
    # norm measured over 150 positions. Wrong columns: ~100%.
    assert float((tiled - per_row).norm() / per_row.norm()) < 0.02
    assert not torch.equal(tiled, per_row)  # the rows did take another path
    # Against float32 weights, the tiles add nothing to Q8_0's own error (6.1-7.1% both ways).
    floats = load_backend("torch", LoadOptions(model=str(path), dtype="float32", warmup=False)).decoder_weights
    expected = BatchedDecoder(floats, 1).logits_after(long, every_position=True)
    error = float((tiled - expected).norm() / expected.norm())
    assert error < 1.1 * float((per_row - expected).norm() / expected.norm()) + 0.005
    monkeypatch.setattr(torch_decoder, "PROMPT_TILES_FROM", 1 << 30)
    assert drive(BatchedDecoder(weights, 1, prefill_chunk=256), [sequence]).ids[1] == alone.ids[1]


def test_only_a_long_prompts_tokens_take_the_tiles(family_paths, monkeypatch):
    """The rows a compiled pass sends to AMX-BF16's tiles (from `prompt_from` on, the kernels'
    choice where the CPU has them) are a prompt's tokens when it has PROMPT_TILES_FROM or more to
    compute: never a decode row, a draft's tokens (greedy text is the same with drafts as
    without), a short prompt's, or what follows a stored prefix that leaves fewer."""
    backend = load_backend(
        "torch", LoadOptions(model=str(family_paths["llama"]), dtype="float32", quantize="q8_0", warmup=False)
    )
    weights, passes = backend.decoder_weights, []  # (rows, rows to the tiles) of each pass
    original = Network._cpu_pass

    def spy(self, tokens, *args, prompt_from, **kwargs):
        passes.append((len(tokens), len(tokens) - prompt_from))
        return original(self, tokens, *args, prompt_from=prompt_from, **kwargs)

    def tiled() -> int:
        return sum(t for _, t in passes)

    monkeypatch.setattr(Network, "_cpu_pass", spy)
    long, short = prompt_of(PROMPT_TILES_FROM + 8), prompt_of(PROMPT_TILES_FROM - 1)
    together = [Sequence(1, long, Sampling(), 40), Sequence(2, short, Sampling(), 40), Sequence(3, long, Sampling(), 9)]
    plain = drive(BatchedDecoder(weights, 4, prefill_chunk=16), together, arrive_at={2: 3, 3: 5})
    assert tiled() == 2 * len(long) and max(t for _, t in passes) <= 16
    # Drafts of what the model will say (random weights echo no n-grams): verified, kept, exact.
    expected = plain.ids[1][:30]

    def oracle(self, left, vocabulary):
        done = len(self.ids) - len(long)
        return expected[done : done + min(self.length, left)]

    monkeypatch.setattr(PromptLookup, "draft", oracle)
    passes.clear()
    drafted = drive(BatchedDecoder(weights, 1, draft_tokens=4), [Sequence(1, long, Sampling(), 30)])
    assert drafted.ids[1] == expected and drafted.steps < 20
    assert tiled() == len(long) and all(t == 0 for _, t in passes[1:])
    decoder = BatchedDecoder(weights, 1, prompt_cache_bytes=1 << 24)
    drive(decoder, [Sequence(1, long, Sampling(), 4)])
    passes.clear()
    again = drive(decoder, [Sequence(2, long + plain.ids[1][:8], Sampling(), 4)])
    assert again.cached[2] >= len(long) and tiled() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_stays_close_to_float32(family_paths, family, float_family_backends):
    """Llama.cpp's Q8_0 weights and Q8 activations against float32, teacher-forced."""
    quantized = load_backend(
        "torch", LoadOptions(model=str(family_paths[family]), dtype="float32", quantize="q8_0", warmup=False)
    )
    decodable = quantized.decoder_weights.decodable
    got = BatchedDecoder(quantized.decoder_weights, 1).logits_after(PROMPT)[:decodable]
    expected = BatchedDecoder(float_family_backends(family).decoder_weights, 1).logits_after(PROMPT)[:decodable]
    # Random tiny weights amplify rounding: measured 2.3-5.9% for Q8_0, 2.0-4.8% for weight-only
    # int8 (bfloat16 activations), 6.6-10.7% for w8a8; a wrong layout would be ~100%.
    assert float((got - expected).norm() / expected.norm()) < 0.08


@pytest.fixture(scope="module")
def float_family_backends(family_paths):
    loaded = {}

    def get(family: str):
        if family not in loaded:
            options = LoadOptions(model=str(family_paths[family]), dtype="float32", warmup=False)
            loaded[family] = load_backend("torch", options)
        return loaded[family]

    return get


def test_the_kernels_say_which_simd_path_they_took():
    assert kernels().simd() in ("avx2+avx512vnni+amx", "avx2+avx512vnni", "avx2+avxvnni", "avx2", "scalar")


def test_without_a_compiler_block_weights_are_a_clear_startup_error(monkeypatch, tmp_path, tiny_path):
    import backends.torch.cpu.kernels as cpu

    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    from backends.contract import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"could not be built: .*need a C\+\+ compiler"):
        load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize="q8_0", warmup=False))
    # float weights serve on torch's operators as before
    backend = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", warmup=False))
    assert BatchedDecoder(backend.decoder_weights, 2).network.cpu_step is None


def test_phi2_cpu_march_builds_the_kernels_for_that_target(monkeypatch):
    """PHI2_CPU_MARCH=x86-64-v3 serves the AVX2 path on a wider CPU (how BENCHMARKS.md times it
    here); a name that is not a target is a clear startup error, not a shell word."""
    import platform

    import backends.torch.cpu.kernels as cpu
    from backends.contract import ModelLoadError

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setenv("PHI2_CPU_MARCH", "x86-64-v3")
    assert cpu.kernels().simd() == "avx2"
    assert cpu.kernels().__name__ == cpu.variant("x86-64-v3").__name__
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setenv("PHI2_CPU_MARCH", "native; rm -rf /")
    with pytest.raises(ModelLoadError, match="PHI2_CPU_MARCH='native; rm -rf /' is not a target name"):
        cpu.kernels()
    assert not cpu.available()  # remembered


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "plain-c++"])
def test_every_simd_path_computes_the_same_products(march):
    """The CPUs that serve differ (AVX2 only, AVX-512 with VNNI): the AVX2 path and the plain C++
    one, built here for those targets, give this machine's products up to float32 sums, rows
    alike alone or together (the AVX-512 path is the native build's where the CPU has it)."""
    import platform

    from backends.torch.cpu.kernels import variant

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    other = variant(march)
    for name in TYPES:
        block = BlockWeight.quantize(weights(), name)
        x = torch.randn(6, block.in_features, generator=torch.Generator().manual_seed(7))
        native = kernels().mm(x, block.raw, block.ggml_type, block.in_features)
        built = other.mm(x, block.raw, block.ggml_type, block.in_features)
        assert float((built - native).abs().max()) <= 1e-4 * float(native.abs().max()), name
        assert torch.equal(other.mm(x[-1:], block.raw, block.ggml_type, block.in_features), built[-1:])
        assert torch.equal(other.dequantize(block.raw, block.ggml_type, block.in_features), block.dequantize())
        packed = kernels().pack(block.raw, block.ggml_type, block.in_features)
        assert torch.equal(other.pack(block.raw, block.ggml_type, block.in_features), packed)
        kind = block.ggml_type + 100
        native = kernels().mm(x, packed, kind, block.in_features)
        built = other.mm(x, packed, kind, block.in_features)
        assert float((built - native).abs().max()) <= 1e-4 * float(native.abs().max()), name
        assert torch.equal(other.mm(x[-1:], packed, kind, block.in_features), built[-1:])


@pytest.mark.parametrize(
    ("types", "kind"),
    [
        (["Q4_1", "Q4_1", "Q8_0"], "q4_1"),  # SmolLM2's file: its own blocks
        (["Q4_K", "Q4_K", "Q6_K"], "q4_k"),  # Q4_K_M: its own blocks too (cpu_kquants.h)
        (["Q5_0", "Q5_0", "Q8_0"], "q5_0"),
        (["Q3_K", "Q3_K", "Q8_0"], "q8_0"),  # mostly a type the kernels do not multiply: Q8_0
        (["Q4_K", "Q4_0", "Q4_0"], "q4_0"),  # mostly a type the kernels multiply: that one
        (["F16", "F32"], None),  # floats: served as float
    ],
)
def test_a_files_matrices_choose_the_block_type_it_is_served_in(tmp_path, types, kind):
    """Its most common type where the kernels multiply it; Q8_0 blocks where most matrices are
    in a quantized type they do not (Q2_K, Q3_K); float where none is quantized. The answer is
    kept beside the converted checkpoint, under the rule that gave it."""
    import gguf

    from backends.torch.quant.blocks import KIND_RULE, file_kind

    file = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(file), "llama")
    for block, name in enumerate(types):
        kind_type = gguf.GGMLQuantizationType[name]
        size, width = gguf.GGML_QUANT_SIZES[kind_type]
        raw = np.zeros((4, 256 // size * width), dtype=np.uint8)
        writer.add_tensor(f"blk.{block}.attn_q.weight", raw, raw_dtype=kind_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "converted"
    folder.mkdir()
    assert file_kind(file, folder) == kind
    assert json.loads((folder / "block_type.json").read_text()) == {"type": kind, "rule": KIND_RULE}
    (folder / "block_type.json").write_text(json.dumps({"type": "q4_0"}))  # kept by an older rule: read again
    assert file_kind(file, folder) == kind
    file.unlink()
    assert file_kind(file, folder) == kind  # kept: the file is not read
