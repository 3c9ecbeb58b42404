"""Per-request LoRA adapters on MLX (issue 17): each sequence decodes with its own adapter,
unmerged, in a batch it shares with other adapters and the base model, exactly as mlx-lm's own
LoRA layers (`mlx_lm.load(..., adapter_path=...)`) decode it alone."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import write_mlx_adapter

from backends.choose import load_backend
from backends.contract import LoadOptions, ModelLoadError, Sampling, Sequence

mx = pytest.importorskip("mlx.core")

PROMPTS = ["Once upon a time", "The quick brown", "Alice: How are you today?\nBob:", "def f(x):\n"]
ADAPTERS = [None, "alpha", "beta", "gamma"]  # None: the base model
N = 24  # tokens a sequence generates


@pytest.fixture(scope="module")
def adapters_dir(tiny_path, tmp_path_factory) -> Path:
    """Three adapters that differ in rank, scale, blocks and layers."""
    root = tmp_path_factory.mktemp("adapters")
    write_mlx_adapter(tiny_path, root / "alpha", num_layers=2, rank=4, scale=2.0)
    write_mlx_adapter(tiny_path, root / "beta", num_layers=1, rank=8, scale=4.0)
    only_some_layers(
        write_mlx_adapter(tiny_path, root / "gamma", num_layers=2, rank=2, scale=6.0), ["self_attn.q_proj", "mlp.fc2"]
    )
    return root


def only_some_layers(path: Path, keys: list[str]) -> None:
    """Keep an adapter's LoRA on `keys` only (lora_parameters.keys, as mlx-lm reads it)."""
    weights = {
        k: v for k, v in mx.load(str(path / "adapters.safetensors")).items() if any(f".{key}." in k for key in keys)
    }
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    config = json.loads((path / "adapter_config.json").read_text())
    config["lora_parameters"]["keys"] = keys
    (path / "adapter_config.json").write_text(json.dumps(config))


def load(tiny_path, adapters_dir, **options):
    return load_backend(
        "mlx",
        LoadOptions(model=str(tiny_path), adapters_dir=str(adapters_dir), dtype="float32", warmup=False, **options),
    )


@pytest.fixture(scope="module")
def backend(tiny_path, adapters_dir):
    return load(tiny_path, adapters_dir)


@pytest.fixture(scope="module")
def reference_model(tiny_path, adapters_dir):
    """name -> the tiny model with mlx-lm's own LoRA layers for that adapter (None: none)."""
    from mlx_lm import load as mlx_load

    models = {}

    def model(name: str | None):
        if name not in models:
            models[name] = mlx_load(str(tiny_path), adapter_path=str(adapters_dir / name) if name else None)[0]
        return models[name]

    return model


@pytest.fixture(scope="module")
def reference(backend, reference_model):
    """reference(adapter name, prompt ids, n, sampling) -> the ids mlx-lm's generate_step gives
    with that adapter's LoRA layers (and this server's sampler for the sampling)."""
    from mlx_lm.generate import generate_step

    from backends.mlx.sampling import logits_processors, make_sampler

    def ids(name: str | None, prompt: list[int], n: int = N, sampling: Sampling = Sampling()) -> list[int]:
        sampler = make_sampler(sampling, prompt, backend.decodable)
        steps = generate_step(
            mx.array(prompt),
            reference_model(name),
            max_tokens=n,
            sampler=sampler,
            logits_processors=logits_processors(sampler),
        )
        return [int(token) for token, _ in steps]

    return ids


def sequence(backend, seq_id: int, name: str | None, prompt: str, n: int = N, **options) -> Sequence:
    adapter = backend.adapters.get(name) if name else None
    return Sequence(seq_id, backend.encode(prompt), options.pop("sampling", Sampling()), n, adapter=adapter, **options)


def run(decoder, joining: dict[int, list[Sequence]], steps: int = 400) -> dict[int, list[int]]:
    """Decode until every sequence has its tokens; `joining`: step -> sequences added then."""
    ids, wanted = {}, {}
    for step in range(steps):
        for s in joining.get(step, []):
            decoder.add(s)
            ids[s.id], wanted[s.id] = [], s.max_new_tokens
        for seq_id, advanced in decoder.step().items():
            ids[seq_id] += advanced
            if len(ids[seq_id]) == wanted[seq_id]:
                decoder.remove(seq_id)
        if step >= max(joining) and all(len(ids[i]) == wanted[i] for i in ids):
            return ids
    raise AssertionError(f"not done after {steps} steps: {ids}")


def alone(decoder, s: Sequence) -> list[int]:
    return run(decoder, {0: [s]})[s.id]


# -- one sequence ------------------------------------------------------------------------------


def test_the_adapters_differ_from_each_other_and_from_the_base_model(backend, reference):
    prompt = backend.encode(PROMPTS[0])
    outputs = [tuple(reference(name, prompt)) for name in ADAPTERS]
    assert len(set(outputs)) == len(ADAPTERS)


@pytest.mark.parametrize("max_batch", [1, 4])
@pytest.mark.parametrize("name", ADAPTERS)
def test_each_adapter_decodes_as_mlx_lm_with_it(backend, reference, name, max_batch):
    decoder = backend.decoder(max_batch, prompt_cache_bytes=0)
    for i, prompt in enumerate(PROMPTS):
        s = sequence(backend, i, name, prompt)
        assert alone(decoder, s) == reference(name, s.prompt_ids), prompt


def test_slot_layers_are_installed_only_where_an_adapter_needs_them(tiny_path, adapters_dir):
    from backends.mlx.lora import SlotLoRALinear

    fresh = load(tiny_path, adapters_dir)

    def slot_layers():
        return {name for name, m in fresh.model.named_modules() if isinstance(m, SlotLoRALinear)}

    alone(fresh.decoder(1, 0), sequence(fresh, 1, None, PROMPTS[0]))
    assert slot_layers() == set()
    alone(fresh.decoder(1, 0), sequence(fresh, 2, "gamma", PROMPTS[0]))
    assert slot_layers() == set(fresh.adapters.get("gamma").modules)
    assert {n.rsplit(".", 1)[1] for n in slot_layers()} == {"q_proj", "fc2"}


# -- a shared batch ----------------------------------------------------------------------------


def test_a_mixed_batch_gives_every_sequence_its_own_adapters_ids(backend, reference):
    decoder = backend.decoder(6, prompt_cache_bytes=0)
    joining = {
        0: [sequence(backend, 0, None, PROMPTS[0], 40), sequence(backend, 1, "alpha", PROMPTS[1], 30)],
        3: [sequence(backend, 2, "beta", PROMPTS[2])],
        5: [sequence(backend, 3, "alpha", PROMPTS[3], 12), sequence(backend, 4, "gamma", PROMPTS[0])],
        20: [sequence(backend, 5, None, PROMPTS[1]), sequence(backend, 6, "beta", PROMPTS[0], 10)],
    }
    got = run(decoder, joining)
    for s in (s for group in joining.values() for s in group):
        assert got[s.id] == reference(s.adapter and s.adapter.name, s.prompt_ids, s.max_new_tokens), s.id
    assert not decoder._bank.active  # every slot released


def test_penalties_and_grammars_see_plain_ids_in_a_mixed_batch(backend, reference):
    # The sampler chooses among plain ids; only then is the slot's offset added.
    penalized = Sampling(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)
    grammar = backend.constraint("regex", "[0-9]{3}-[a-z ]{3,12}")
    digits = Sampling(constraint=grammar.matcher())
    decoder = backend.decoder(4, prompt_cache_bytes=0)
    joining = {
        0: [sequence(backend, 0, "alpha", PROMPTS[0], sampling=penalized), sequence(backend, 1, None, PROMPTS[1])],
        2: [
            sequence(backend, 2, "beta", "Numbers:", 8, sampling=digits),
            sequence(backend, 3, "beta", PROMPTS[2], sampling=penalized),
        ],
    }
    got = run(decoder, joining)
    for s in (s for group in joining.values() for s in group):
        # A sequence walks a grammar with a matcher of its own: the reference gets a fresh one.
        sampling = (
            s.sampling
            if s.sampling.constraint is None
            else dataclasses.replace(s.sampling, constraint=grammar.matcher())
        )
        assert got[s.id] == reference(s.adapter and s.adapter.name, s.prompt_ids, s.max_new_tokens, sampling), s.id
    text = backend.decode(got[2])
    assert re.fullmatch("[0-9]{3}-[a-z ]{0,12}", text), text


# -- the prompt cache --------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_prompt_cache_never_serves_one_adapter_to_another(backend, reference, max_batch):
    decoder = backend.decoder(max_batch, prompt_cache_bytes=1 << 30)
    prompt = PROMPTS[2]
    order = ["alpha", "beta", None, "alpha", "beta", None]
    for i, name in enumerate(order):
        s = sequence(backend, i, name, prompt)
        reused = decoder.add(s)
        got = []
        while len(got) < N:
            got += decoder.step().get(s.id, [])
        decoder.remove(s.id)
        assert got == reference(name, s.prompt_ids), (i, name)
        if i < 3:  # first time with that adapter: nothing of the others' KV
            assert reused == 0, (i, name)
        else:  # again: its own prompt (and generated ids) are there
            assert reused == len(s.prompt_ids) - 1, (i, name)


# -- slots -------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch", [1, 4])
def test_one_slot_serves_adapters_one_after_another(tiny_path, adapters_dir, reference, max_batch):
    one = load(tiny_path, adapters_dir, max_adapters=1)
    decoder = one.decoder(max_batch, prompt_cache_bytes=1 << 30)
    assert decoder.adapter_slots == 1
    for i, name in enumerate(["alpha", "beta", "gamma", "alpha", None, "beta"]):
        s = sequence(one, i, name, PROMPTS[i % len(PROMPTS)])
        assert alone(decoder, s) == reference(name, s.prompt_ids), (i, name)


def test_a_slot_is_reused_by_its_adapter_and_refilled_for_another(backend):
    from backends.mlx.lora import SlotBank

    bank = SlotBank(backend.model, backend.router, 2)
    alpha, beta, gamma = (backend.adapters.get(n) for n in ("alpha", "beta", "gamma"))
    a = bank.acquire(alpha)
    assert bank.acquire(alpha) == a and bank.active
    b = bank.acquire(beta)
    assert b != a
    factors = bank.factors["model.layers.1.self_attn.q_proj"]
    assert factors[0].shape[1] == 4 + 8 and sorted(set(factors[2].tolist())) == sorted([a, b])
    for slot in (a, a, b):
        bank.release(slot)
    assert not bank.active
    g = bank.acquire(gamma)  # the least recently used slot is refilled: alpha's
    assert g == a and bank.table.keys[b] == beta.key
    # beta adapts block 1 only; gamma q_proj and fc2 of both: what neither adapts any more is gone
    assert "model.layers.0.self_attn.k_proj" not in bank.factors
    assert sorted(set(bank.factors["model.layers.0.mlp.fc2"][2].tolist())) == [g]
    assert sorted(set(bank.factors["model.layers.1.self_attn.q_proj"][2].tolist())) == sorted([g, b])


# -- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch", [1, 4])
def test_logprobs_are_the_adapted_models_own(backend, reference_model, max_batch):
    decoder = backend.decoder(max_batch, prompt_cache_bytes=0)
    s = sequence(backend, 7, "beta", PROMPTS[0], 10, logprobs=3, prompt_logprobs=2)
    decoder.add(s)
    ids, steps = [], []
    while len(ids) < s.max_new_tokens:
        tokens = decoder.step()
        if s.id in tokens:
            ids += tokens[s.id]  # one: it asked for logprobs
            steps.append(decoder.logprobs[s.id])
    decoder.remove(s.id)

    everything = s.prompt_ids + ids
    logits = reference_model("beta")(mx.array(everything[:-1])[None])[0].astype(mx.float32)
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    prompt_scores = steps[0].prompt
    assert [p.token for p in prompt_scores] == s.prompt_ids[1:]
    for position, score in enumerate(prompt_scores):
        assert score.logprob == pytest.approx(expected[position][score.token], abs=1e-4)
    for i, step in enumerate(steps):
        row = expected[len(s.prompt_ids) - 1 + i]
        assert step.token.token == ids[i]
        assert step.token.logprob == pytest.approx(row[ids[i]], abs=1e-4)
        assert [t for t, _ in step.token.top] == sorted(range(len(row)), key=lambda t: -row[t])[:3]
        for token, logprob in step.token.top:
            assert logprob == pytest.approx(row[token], abs=1e-4)


# -- loading -----------------------------------------------------------------------------------


def test_adapter_path_is_the_default_adapter_checked_at_load(tiny_path, adapters_dir):
    adapted = load_backend(
        "mlx", LoadOptions(model=str(tiny_path), adapter_path=str(adapters_dir / "beta"), warmup=False)
    )
    assert adapted.info.adapter_applied and adapted.adapters.default_name == "beta"
    assert adapted.adapters.loaded() == ["beta"]


def test_dora_is_refused_at_load(tiny_path, tmp_path):
    path = write_mlx_adapter(tiny_path, tmp_path / "dora", dora=True)
    with pytest.raises(ModelLoadError, match="ADAPTER_PATH.*'dora' cannot be applied per request"):
        load_backend("mlx", LoadOptions(model=str(tiny_path), adapter_path=str(path), warmup=False))


def test_adapters_over_a_quantized_model_decode_as_mlx_lm_with_them(tiny_path, adapters_dir):
    from mlx_lm import load as mlx_load
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_adapters, quantize_model

    quantized = load(tiny_path, adapters_dir, quantize="8")
    for name in ("alpha", "gamma"):
        model, _, config = mlx_load(str(tiny_path), return_config=True)
        model, _ = quantize_model(model, config, group_size=None, bits=8)
        model = load_adapters(model, str(adapters_dir / name))
        s = sequence(quantized, 1, name, PROMPTS[1])
        greedy = lambda logprobs: mx.argmax(logprobs[:, : quantized.decodable], axis=-1)  # noqa: E731
        expected = [int(t) for t, _ in generate_step(mx.array(s.prompt_ids), model, max_tokens=N, sampler=greedy)]
        assert alone(quantized.decoder(4, 0), s) == expected, name
