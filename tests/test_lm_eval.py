"""lm-evaluation-harness against the server: a multiple-choice task scored through
/v1/completions must agree with lm-eval scoring the same checkpoint in-process.

lm-eval's `local-completions` model sends each context + choice as token ids (`prompt`: a
list of id lists), with `echo: true`, `logprobs: 1`, `max_tokens: 1` and `temperature: 0`.
From each choice (matched to its prompt by `index`) it reads `logprobs.token_logprobs` and
`logprobs.top_logprobs` over the continuation, `[ctxlen:-1]`: the echoed prompt then the
one generated token, which it drops. The loglikelihood is their sum; is_greedy holds when
every one equals the largest value of its top_logprobs entry. Its `hf` model runs the
checkpoint through transformers: a log-softmax over the whole model vocabulary (undecodable
ids included) and an argmax over it. Per choice, both must give the same loglikelihood
(float32 noise aside) and the same is_greedy flag.

The task (lm_eval_task/) asks for the endings of the tiny model's training lines, so the
right choice is greedy and the others are not: both flags are exercised. Some right
choices end where the model then predicts end-of-text: the generated token must be
reported (and dropped by lm-eval) even when it is end-of-text.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
from pathlib import Path

import datasets
import lm_eval
import pytest
import yaml
from lm_eval.tasks import TaskManager

from phi2_server import ENGINE

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "tiny_corpus_mc"
TOLERANCE = 1e-4  # float32 on both sides; the sums differ by a few 1e-6 at most


@contextlib.contextmanager
def offline():
    """Nothing here may leave the machine. `datasets` HEADs an S3 URL to count every
    load_dataset, even of a local JSON file, unless offline (read from its config at call
    time, so patched there: the environment variable only counts before its import). Any
    lookup of a host but this one fails, and fails the test."""
    attempts = []
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else str(host)
        if host is not None and name not in ("localhost", "::1") and not name.startswith("127."):
            attempts.append(name)
            raise socket.gaierror(f"{name}: this test must not use the network")
        return real_getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(socket, "getaddrinfo", getaddrinfo)
        patch.setenv("NO_PROXY", "127.0.0.1,localhost")  # requests would send the server's port to a proxy
        yield
    assert attempts == [], f"the evaluation tried to reach {attempts}"


@pytest.fixture(scope="module")
def task_config(tmp_path_factory) -> dict:
    """The task as its YAML says, with the data file by absolute path (datasets resolves a
    relative one against the working directory) and the dataset's cache in a temporary
    directory rather than ~/.cache."""
    config = yaml.safe_load((TASK_DIR / f"{TASK}.yaml").read_text())
    config["dataset_kwargs"] = {
        "data_files": {"test": str(TASK_DIR / f"{TASK}.jsonl")},
        "cache_dir": str(tmp_path_factory.mktemp("lm_eval_datasets")),
    }
    return config


def evaluate(model: str, model_args: dict, task_config: dict) -> dict:
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    assert TASK in manager.all_tasks  # the YAML as committed indexes
    with offline():
        results = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[task_config],
            task_manager=manager,
            log_samples=True,
            bootstrap_iters=0,
            # Leave the test process's random state alone: nothing here samples.
            random_seed=None,
            numpy_random_seed=None,
            torch_random_seed=None,
        )
    assert results is not None
    return results


def evaluate_served(server, tiny_path, backend, batch_size: int, task_config: dict) -> dict:
    """lm-eval's `local-completions` against the live server, which serves the checkpoint under
    its path: lm-eval sends it as `model`, and loads the tokenizer from it to split context from
    continuation."""
    return evaluate(
        "local-completions",
        {
            "model": str(tiny_path),
            "base_url": server.url + "/v1/completions",
            "tokenizer": str(tiny_path),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "batch_size": batch_size,  # prompts in one request
            "num_concurrent": 1,
            "max_retries": 1,  # a refusal fails at once
            "max_length": backend.info.context_length,
            "timeout": 120,
        },
        task_config,
    )


def scores(results: dict) -> list[list[tuple[float, bool]]]:
    """Per example, per choice: (loglikelihood, is_greedy)."""
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    return [[(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]] for sample in samples]


@pytest.fixture(scope="module")
def reference(tiny_path, task_config) -> dict:
    """lm-eval's own transformers model on the checkpoint: once for the module."""
    return evaluate(
        "hf", {"pretrained": str(tiny_path), "dtype": "float32", "device": "cpu", "batch_size": 1}, task_config
    )


def read_log(log_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(log_dir.glob("requests.log*"))
        for line in path.read_text(encoding="utf-8").splitlines()
    ]


def test_reference_scores_every_choice(reference):
    expected = [json.loads(line) for line in (TASK_DIR / f"{TASK}.jsonl").read_text(encoding="utf-8").splitlines()]
    ours = scores(reference)
    assert [len(choices) for choices in ours] == [len(doc["choices"]) for doc in expected]
    flags = {greedy for choices in ours for _, greedy in choices}
    assert flags == {True, False}  # so the comparison of flags below means something
    assert all(math.isfinite(ll) and ll < 0 for choices in ours for ll, _ in choices)


@pytest.mark.parametrize("batch_size", [1, 4], ids=["one-prompt-a-request", "four-prompts-a-request"])
@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_served_loglikelihoods_match_lm_eval_hf(
    request, runtime, batch_size, tiny_path, live_server, log_dir, task_config, reference
):
    backend = request.getfixturevalue(f"{runtime}_backend")
    # Served under the checkpoint's path: lm-eval sends it as `model`, and loads the
    # tokenizer from it to split context from continuation.
    server = live_server(lambda: backend, model=str(tiny_path), max_batch=batch_size)
    served = evaluate_served(server, tiny_path, backend, batch_size, task_config)

    ours, theirs = scores(served), scores(reference)
    assert [len(choices) for choices in ours] == [len(choices) for choices in theirs]
    pairs = [
        (doc, k, a, b)
        for doc, (x, y) in enumerate(zip(ours, theirs, strict=False))
        for k, (a, b) in enumerate(zip(x, y, strict=False))
    ]
    doc, k, a, b = max(pairs, key=lambda pair: abs(pair[2][0] - pair[3][0]))
    assert abs(a[0] - b[0]) <= TOLERANCE, f"example {doc}, choice {k}: served {a[0]!r}, lm-eval hf {b[0]!r}"
    assert [(doc, k, a[1]) for doc, k, a, _ in pairs] == [(doc, k, b[1]) for doc, k, _, b in pairs]  # is_greedy
    assert served["results"][TASK]["acc,none"] == reference["results"][TASK]["acc,none"]

    # The answers came from this server: every prompt was a request (or a share of one)
    # that it answered, and its model read their tokens.
    prompts = sum(len(choices) for choices in theirs)
    calls = [line for line in read_log(log_dir) if line["path"] == "/v1/completions"]
    assert [line["status"] for line in calls] == [200] * math.ceil(prompts / batch_size)
    stats = server.app[ENGINE].stats
    assert stats.prompt_tokens_computed + stats.prompt_tokens_cached > prompts
    assert stats.tokens_generated >= prompts


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_a_quantized_model_scores_the_task_as_full_precision_does(
    method, tiny_path, live_server, task_config, reference
):
    """Torch's 8-bit methods (weight-only, and w8a8's int8 activations) through the served
    API: the task's accuracy and each choice's is_greedy equal full precision's, and each
    loglikelihood is within what 8 bits move it (measured: docs/benchmark-log.md, w8a8 on the CPU)."""
    from backends.choose import load_backend
    from backends.contract import LoadOptions

    backend = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize=method))
    server = live_server(lambda: backend, model=str(tiny_path), max_batch=4)
    served = evaluate_served(server, tiny_path, backend, 4, task_config)
    assert served["results"][TASK]["acc,none"] == reference["results"][TASK]["acc,none"]
    ours, theirs = scores(served), scores(reference)
    assert [[g for _, g in choices] for choices in ours] == [[g for _, g in choices] for choices in theirs]
    worst = max(
        abs(a - b) / abs(b) for x, y in zip(ours, theirs, strict=True) for (a, _), (b, _) in zip(x, y, strict=True)
    )
    assert worst < 0.06, worst  # measured on the tiny model: int8 0.3%, w8a8 2.9% (one range per call)
