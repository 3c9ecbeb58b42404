"""Every curl example in README.md and docs/*.md, run against the real demo app, its documented
answer compared with the real one (issue 27: examples checked, not pasted).

The convention the markdown follows:

- An example is a ```sh (or ```bash) block holding one `curl` command (lines may go on with a
  backslash) whose URL is on localhost:8000. curl's -s, -N, -d/--data, -H, -X and --json are
  understood; `-d` sends curl's form content type, as curl does (the server reads any body as
  JSON).
- The fenced block right after it, when there is one, is the answer, as `curl` prints it:
  ```json (one JSON value), ```ndjson (one JSON value a line: /generate/stream) or ```text. A
  ```text answer to an event stream (SSE) is compared event by event; any other ```text answer
  is the raw body, where a line `...` stands for any number of lines and `...` inside a line
  for any text (the shortened /metrics and /openapi.json).
- An example without an answer block is run too: it must answer 2xx (or its `status`).
- An HTML comment right before an example's block says more about it, in this form:
  `<!-- example: not run (needs Docker) -->`: not run, and listed in NOT_RUN below;
  `<!-- example: status 422 -->`: the status it answers (an answer holding "error" needs one);
  `<!-- example: settings PHI2_API_KEY=key1 -->`: run on a fresh demo app with those settings
  (environment variable names, as in README's configuration table);
  `<!-- example: adapters NAME ... -->`: adapter folders of those names are in ADAPTERS_DIR while
  it runs (made by write_mlx_adapter: rank 8, scale 20, 2 layers, as the documented ones).
  Each directive is checked: one this test does not know fails it.
- Each file's examples run in order against one fresh demo app: the tiny model's
  (PHI2_MODEL=tiny on the Torch runtime, every other setting at its default), on the real tiny
  checkpoint, so `cached_tokens`, `/metrics` counts and `/model/info`'s stats are those of a
  server that has just answered the file's previous examples. HOME is a temporary folder,
  written `/root` in the answers (the default ADAPTER_PATH and ADAPTERS_DIR are under it).
- Values that legitimately vary between runs or machines are masked (MASKED); every other value,
  the generated text and the token counts included, must be equal. Floats (logprobs) need only
  be within 1e-4 relative or 1e-5 absolute: their last digits depend on the order of float32
  sums, which the prompt cache changes (docs/api.md, "Logprobs").

`DOC_EXAMPLES_WRITE=1 pytest tests/test_doc_examples.py` writes the real answers into the
```json, ```ndjson and SSE blocks (never by hand); a shortened ```text answer that no longer
matches is printed, to be shortened again from the real one.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from conftest import write_mlx_adapter

from backends.choose import load_backend
from backends.files.models import tiny_dir
from phi2_server import ENCODER, LOAD_DONE, Settings, create_app, runner_options

ROOT = Path(__file__).resolve().parent.parent
# Not docs/grammar-libraries/ (nor docs/clients/, whose setups need the agent CLIs).
FILES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 20_000  # bytes: the README is the front page, the reference is docs/api.md
SHOWN_HOME = "/root"  # how the answers write the (temporary) home directory
WRITE = os.environ.get("DOC_EXAMPLES_WRITE") == "1"

# Keys whose values vary from run to run or machine to machine: ids and times, and what depends
# on the machine (threads: its cores; budget_bytes: an eighth of its memory). "id" only where it
# is a string (a response id): token ids are numbers, and checked.
MASKED = {
    "id",
    "request_id",
    "created",
    "created_at",  # a response's (the Responses API)
    "call_id",  # a function call's id (the Responses API)
    "system_fingerprint",
    "ttft_ms",
    "total_ms",
    "tokens_per_second",
    "load_time_s",
    "decode_seconds",
    "busy_seconds",
    "threads",
    "budget_bytes",
}

# The examples that are not run, each with its reason: few, and each for something the demo app
# cannot be.
NOT_RUN = [
    ("docs/api.md", "needs the two adapters that mlx_lm.lora trained, a minute each; a shell loop"),
]

FENCE = re.compile(r"^(`{3,})\s*([\w-]*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->$")
CURL = re.compile(r"(^|[\s;&|(])curl\s")
ANSWER_KINDS = ("json", "ndjson", "text")


@dataclass
class Block:
    lang: str
    text: str
    start: int  # index of the first content line in the file's lines
    end: int  # index of the closing fence
    directives: list[str] = field(default_factory=list)


@dataclass
class Example:
    path: Path
    line: int  # 1-based line of the command
    command: str
    directives: list[str]
    answer: Block | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def directive(self, word: str) -> str | None:
        for d in self.directives:
            if d == word or d.startswith(word + " "):
                return d[len(word) :].strip()
        return None


def blocks(lines: list[str]) -> list[Block]:
    """The fenced blocks of a markdown file, each with the example directives right before it."""
    found, i, pending = [], 0, []
    while i < len(lines):
        stripped = lines[i].strip()
        if m := DIRECTIVE.match(stripped):
            pending.append(m.group(1))
        elif m := FENCE.match(stripped):
            fence, j = m.group(1), i + 1
            while j < len(lines) and lines[j].strip() != fence:
                j += 1
            found.append(Block(m.group(2), "\n".join(lines[i + 1 : j]), i + 1, j, pending))
            pending, i = [], j
        elif stripped:
            pending = []
        i += 1
    return found


def examples(path: Path) -> list[Example]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found = blocks(lines)
    result = []
    for k, block in enumerate(found):
        if block.lang not in ("sh", "bash", "shell") or not any(
            CURL.search(line.split(" #")[0]) for line in block.text.splitlines()
        ):
            continue
        answer = None
        if k + 1 < len(found):
            nxt = found[k + 1]
            between = lines[block.end + 1 : nxt.start - 1]
            if not any(line.strip() for line in between) and nxt.lang not in ("sh", "bash", "shell"):
                assert nxt.lang in ANSWER_KINDS, (
                    f"{path.name}:{nxt.start}: an answer block is ```json, ```ndjson or ```text"
                )
                answer = nxt
        result.append(Example(path, block.start + 1, block.text, block.directives, answer))
    return result


def all_examples() -> list[Example]:
    return [e for path in FILES for e in examples(path)]


# -- curl, as the examples use it -----------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None


def parse_curl(command: str) -> Request:
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    assert words and words[0] == "curl", f"not one curl command: {command!r}"
    method, url, headers, body = None, None, {}, None
    args = iter(words[1:])
    for word in args:
        if word in ("-d", "--data", "--data-raw", "--data-binary", "--json"):
            assert body is None, f"one body only: {command!r}"
            body = next(args).encode()
            assert not body.startswith(b"@"), "a body from a file is not supported"
            if word == "--json":
                headers["Content-Type"] = headers["Accept"] = "application/json"
        elif word in ("-H", "--header"):
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif word in ("-X", "--request"):
            method = next(args)
        elif re.fullmatch(r"-[sN]+|--silent|--no-buffer", word):
            pass
        elif word.startswith("-"):
            raise AssertionError(f"curl option {word} is not understood by this test")
        else:
            assert url is None, f"two URLs in {command!r}"
            url = word
    if body is not None and "content-type" not in {name.lower() for name in headers}:
        headers["Content-Type"] = "application/x-www-form-urlencoded"  # what curl -d sends
    m = re.fullmatch(r"(?:https?://)?(?:localhost|127\.0\.0\.1):8000(/\S*)", url or "")
    assert m, f"the URL must be on localhost:8000: {url!r}"
    return Request(method or ("POST" if body is not None else "GET"), m.group(1), headers, body)


# -- comparing answers ----------------------------------------------------------------------------


def mask(value):
    if isinstance(value, dict):
        return {
            k: "<masked>" if k in MASKED and (k != "id" or isinstance(v, str)) else mask(v) for k, v in value.items()
        }
    if isinstance(value, list):
        return [mask(v) for v in value]
    return value


def same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
        return numbers and math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert not line.strip(), f"not an SSE data line: {line!r}"
    return events


def elided_match(documented: str, actual: str) -> bool:
    """`...` as a whole line: any number of lines; `...` inside a line: any text."""
    patterns = [
        None if line.strip() == "..." else re.compile(".*".join(map(re.escape, line.split("..."))))
        for line in documented.splitlines()
    ]
    lines = actual.splitlines()

    def match(p: int, a: int) -> bool:
        if p == len(patterns):
            return a == len(lines)
        if patterns[p] is None:
            return any(match(p + 1, b) for b in range(a, len(lines) + 1))
        return a < len(lines) and patterns[p].fullmatch(lines[a]) is not None and match(p + 1, a + 1)

    return match(0, 0)


def parsed(answer: Block, content_type: str, actual: str):
    """(documented, real), masked, for the answers compared as JSON; None for raw text."""
    if answer.lang == "json":
        return mask(json.loads(answer.text)), mask(json.loads(actual))
    if answer.lang == "ndjson":
        documented = [json.loads(line) for line in answer.text.splitlines() if line.strip()]
        return mask(documented), mask([json.loads(line) for line in actual.splitlines()])
    if content_type == "text/event-stream":
        return mask(sse_events(answer.text)), mask(sse_events(actual))
    return None


def compare(answer: Block, content_type: str, actual: str) -> bool:
    pair = parsed(answer, content_type, actual)
    return same(*pair) if pair else elided_match(answer.text, actual)


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if same(a, b) else [f"{where or 'the answer'}: documented {a!r:.200}, real {b!r:.200}"]


def explain(answer: Block, content_type: str, actual: str) -> str:
    pair = parsed(answer, content_type, actual)
    if pair:
        found = "\n  ".join(differences(*pair))
    else:
        lines = actual.splitlines()
        missing = [
            line
            for line in answer.text.splitlines()
            if line.strip() != "..." and not any(elided_match(line, real) for real in lines)
        ]
        found = "\n  ".join(f"no line like {line!r}" for line in missing) or "the lines come in another order"
    return f"  {found}\nthe real answer:\n{actual[:3000]}"


def expected_status(example: Example) -> int | None:
    status = example.directive("status")
    return int(status) if status else None


# -- the demo app ---------------------------------------------------------------------------------


@dataclass
class Demo:
    home: Path
    backend: object

    def settings(self, **overrides) -> Settings:
        # The tiny model's app: PHI2_MODEL=tiny, everything else at its default (the runtime
        # named, so that a Mac runs the same Torch answers); the log in the temporary home.
        return Settings(model="tiny", backend="torch", log_dir=str(self.home / "logs"), **overrides)

    def shown(self, text: str) -> str:
        for home in {str(self.home.resolve()), str(self.home)}:
            text = text.replace(home, SHOWN_HOME)
        return text


@pytest.fixture(scope="module")
def demo(tiny_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOME", str(home))  # the default ADAPTER_PATH and ADAPTERS_DIR are under ~
        env.setenv("PHI2_CACHE_DIR", str(home / ".cache" / "phi2-server"))
        tiny_dir().parent.mkdir(parents=True)
        tiny_dir().symlink_to(tiny_path)  # PHI2_MODEL=tiny finds the session's checkpoint there
        demo = Demo(home, None)
        demo.backend = load_backend("torch", demo.settings().load_options())
        yield demo


async def serve(aiohttp_client, demo: Demo, **settings):
    app = create_app(demo.settings(**settings), load=lambda: demo.backend)
    server = TestServer(app)
    await server.start_server(**{k: v for k, v in runner_options(app).items() if k != "handler_cancellation"})
    client = await aiohttp_client(server)
    await asyncio.wait_for(app[LOAD_DONE].wait(), 30)
    while app[ENCODER].status == "loading":  # EMBEDDING_MODEL and RERANK_MODEL, where set
        await asyncio.sleep(0.01)
    return client


def settings_of(spec: str) -> dict:
    """`PHI2_API_KEY=key1 RATE_LIMIT=2` -> Settings fields (the README's variable names)."""
    by_env = {Settings.env_name(f.name): f for f in fields(Settings)}
    result = {}
    for word in shlex.split(spec):
        env, _, value = word.partition("=")
        assert env in by_env, f"no setting {env}"
        kind = {"int": int, "float": float, "bool": lambda v: v not in ("0", "")}.get(by_env[env].type, str)
        result[by_env[env].name] = kind(value)
    return result


def adapters_for(demo: Demo, spec: str, sources: Path, tiny_path: Path) -> list[Path]:
    made = []
    for name in spec.split():
        source = sources / name
        if not source.exists():
            write_mlx_adapter(tiny_path, source, num_layers=2, rank=8, scale=20.0)
        target = demo.home / "ml-experiment" / "experiments" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, target)
        made.append(target)
    return made


async def run_example(client, example: Example) -> tuple[int, str, str]:
    request = parse_curl(example.command)
    response = await client.request(request.method, request.path, data=request.body, headers=request.headers)
    body = (await response.read()).decode("utf-8")
    return response.status, response.content_type, body.rstrip("\n")


def write_answer(example: Example, actual: str) -> None:
    lines = example.path.read_text(encoding="utf-8").split("\n")
    answer = example.answer
    assert "\n".join(lines[answer.start : answer.end]) == answer.text, "the file changed under the test"
    lines[answer.start : answer.end] = actual.split("\n")
    example.path.write_text("\n".join(lines), encoding="utf-8")


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
async def test_every_example_gives_its_documented_answer(aiohttp_client, demo, tiny_path, tmp_path, path):
    client, results = None, []
    for example in [e for e in examples(path) if e.directive("not run") is None]:
        made = []
        try:
            if spec := example.directive("adapters"):
                made = adapters_for(demo, spec, tmp_path / "adapters", tiny_path)
            if spec := example.directive("settings"):
                own = await serve(aiohttp_client, demo, **settings_of(spec))
                try:
                    status, content_type, body = await run_example(own, example)
                finally:
                    await own.close()
            else:
                client = client or await serve(aiohttp_client, demo)
                status, content_type, body = await run_example(client, example)
        finally:
            for folder in made:
                shutil.rmtree(folder)
        results.append((example, status, content_type, demo.shown(body)))

    failures = []
    for example, status, content_type, body in reversed(results):  # reversed: writing keeps line numbers
        wanted = expected_status(example)
        if wanted is not None and status != wanted:
            failures.append(f"{example.name}: status {status}, documented {wanted}: {body[:300]}")
        if wanted is None and not 200 <= status < 300:
            failures.append(f"{example.name}: status {status} (an error example says its `status`): {body[:300]}")
        answer = example.answer
        if answer is None:
            continue
        if answer.lang == "json" and wanted is None and json.loads(answer.text).get("error") is not None:
            failures.append(f"{example.name}: an error answer needs `<!-- example: status N -->`")
        if not compare(answer, content_type, body):
            if WRITE and (answer.lang != "text" or content_type == "text/event-stream"):
                write_answer(example, body)
            else:
                failures.append(f"{example.name}: the real answer differs:\n{explain(answer, content_type, body)}")
    assert not failures, "\n\n".join(reversed(failures))


def test_the_examples_follow_the_convention():
    found = all_examples()
    for example in found:
        for d in example.directives:
            assert re.fullmatch(r"not run \(.+\)|status \d{3}|settings .+|adapters .+", d), f"{example.name}: {d!r}"
    not_run = [(str(e.path.relative_to(ROOT)), e.directive("not run")[1:-1]) for e in found if e.directive("not run")]
    assert not_run == NOT_RUN  # few, each with its reason
    run = [e for e in found if e.directive("not run") is None]
    assert len(run) >= 20, len(run)  # 24 when written: a parser that breaks finds none
    for example in run:
        parse_curl(example.command)  # one curl command this test understands
        if example.directive("settings"):
            settings_of(example.directive("settings"))


def test_inline_curl_commands_are_examples_that_run():
    """A `curl ...` in running text or a table (the README's endpoint table) is one of the
    examples that run, word for word."""
    commands = {
        " ".join(e.command.replace("\\\n", " ").split()) for e in all_examples() if e.directive("not run") is None
    }
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"^(`{3,}).*?^\1", "", text, flags=re.S | re.M)  # not inside fenced blocks
        for span in re.findall(r"`(curl [^`]*localhost:8000[^`]*)`", text):
            assert " ".join(span.split()) in commands, f"{path.name}: `{span}` is not an example that runs"


def test_the_readme_is_a_front_page():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; the reference belongs in docs/"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    text = re.sub(r"^(`{3,}).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result | set(re.findall(r'<a id="([^"]+)"></a>', text))  # BENCHMARKS.md's decisions


def test_links_between_the_docs_land_on_a_heading():
    for path in FILES:
        text = re.sub(r"^(`{3,}).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # another site
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.name}: a link to {target}, which is not there"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{path.name}: a link to {target}, which has no such heading"


def test_the_configuration_table_names_every_setting():
    """README's table has one row a setting, and the flag rule it states holds for each."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Configuration") :]
    table = table[: table.index("\n## ")]
    documented = re.findall(r"^\| `([A-Z0-9_]+)` \|", table, flags=re.M)
    names = [Settings.env_name(f.name) for f in fields(Settings)]
    assert sorted(documented) == sorted([*names, "PHI2_CACHE_DIR"])
    for f in fields(Settings):  # its flag is --f.name: the variable in lower case, without PHI2_
        assert f.name == Settings.env_name(f.name).removeprefix("PHI2_").lower()
