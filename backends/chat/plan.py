"""One chat request as the model serves it: `Backend.chat_plan(ChatRequest) -> ChatPlan`.

Every chat API (/v1/chat/completions, /v1/responses, /v1/messages) translates its request onto
one shared form, a `ChatRequest`: messages, the tools that may be called and how, a response
format. The model answers with one `ChatPlan`: the prompt its chat template renders (tools in
it), the stops its format needs, the grammar of its calls (or of the response format), the tags
the reply's text keeps, and a parser per choice that splits the reply into content, reasoning
and calls. What a model knows about chat is read once, here (`ChatFormat`): its template, its
tool format (backends.chat.tools) and whether it reasons in <think> tags. So the three APIs cannot
drift apart, and what changes a chat for every API (issue 53's reasoning controls: thinking
budgets, effort, chat_template_kwargs) is a field of ChatRequest read in `ChatFormat.plan`.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field

from jinja2 import TemplateError

from backends.chat import tools
from backends.chat.tools import ToolCallParser, ToolFormat
from backends.errors import ChatError


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools: what the model may call, whether it must."""

    # {name, description, parameters}, or a custom tool's {name, description, custom: {syntax,
    # definition}} (backends.chat.tools.as_function): rendered into the prompt
    tools: list[dict]
    choice: str  # "auto", "required" or one function's name ("none": no ToolUse at all)
    parallel: bool

    @property
    def callable(self) -> list[dict]:
        return (
            self.tools if self.choice in ("auto", "required") else [t for t in self.tools if t["name"] == self.choice]
        )


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar to compile for the model's tokenizer (`Backend.constraint(kind, spec)`)."""

    kind: str  # "tool_calls", "json_object", "json_schema", or "thinking" (one of them, or none, after a thought)
    spec: str
    lazy: bool = False  # armed only when a call opens (tool_choice auto): the text beside it ends as any text


@dataclass(frozen=True)
class ChatRequest:
    """What a chat asks of the model, whichever API it came by."""

    # {role, content: str}; an assistant's `tool_calls` (arguments as JSON text), `tool` results
    # answering them: the HTTP layer has checked them.
    messages: list[dict]
    tools: ToolUse | None = None  # None: nothing may be called, and no tools are rendered
    response_format: GrammarSpec | None = None  # the reply's JSON grammar; never with tools
    # What the chat template reads besides the messages (vLLM's chat_template_kwargs), and
    # whether the model is asked to think: `enable_thinking`, as Qwen3's template reads it,
    # unless the kwargs say; None leaves it to the template.
    template_kwargs: dict = field(default_factory=dict)
    thinking: bool | None = None
    # The most tokens the reply may reason for (None: no limit): then only </think> is allowed,
    # where the model's tokenizer has <think> and </think> as tokens (backends.decoding.grammar.ThinkingGrammar).
    thinking_budget: int | None = None


# A reply's reasoning, by the tokens a vocabulary has: the text that opens and closes it (what the
# parser splits on), and the tokens that do (what the thinking budget's grammar counts between).
# Gemma 4 names its channel after the opening token: <|channel>thought ... <channel|>.
REASONING_TAGS = (
    (("<think>", "</think>"), ("<think>", "</think>")),
    (("<|channel>thought", "<channel|>"), ("<|channel>", "<channel|>")),
)


@dataclass(frozen=True)
class ChatPlan:
    """How the model serves one ChatRequest: what to generate from, where to stop, what to
    keep, and how to read the reply."""

    prompt: str  # the rendered chat, generation prompt opened (tokenized where the request is submitted)
    stop: tuple[str, ...]  # the chat format's own, added to the request's stop sequences
    grammar: GrammarSpec | None  # the calls' (tools) or the response format's; None: free text
    keep_tokens: tuple[tuple[int, str], ...]  # tags the reply's text keeps (Request.keep_tokens)
    tool_format: ToolFormat
    tool_names: frozenset[str] | None  # what the parser reads calls to; None: no calls are looked for
    reasoning: bool  # <think>...</think> (`think`) is split off the reply as reasoning
    thinking: bool  # the prompt opened <think>: the reply starts inside its reasoning
    # <think>'s and </think>'s ids where both are single tokens, and `thinking` (Request.thought)
    thought: tuple[int, int, bool] | None = None
    custom_names: frozenset[str] = frozenset()  # the tools among tool_names whose input is raw text
    think: tuple[str, str] = REASONING_TAGS[0][0]  # the text that opens and closes reasoning (REASONING_TAGS)

    def parser(self) -> ToolCallParser:
        """A fresh parser for one choice's text (each choice, and each fold of a whole reply)."""
        return ToolCallParser(
            self.tool_format,
            self.tool_names,
            reasoning=self.reasoning,
            thinking=self.thinking,
            custom=self.custom_names,
            think=self.think,
        )


class ChatFormat:
    """A model's chat, read from its Hugging Face tokenizer: the chat template (Phi-2's model-card
    dialogue where there is none), the tool format it writes, and its reasoning tags."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.has_template = bool(template)
        self.tool_format, self.template_knows_tools = tools.detect_format(
            template if isinstance(template, str) else None
        )
        if not self.template_knows_tools:
            self.tool_format = tools.DEFAULT_FORMAT  # the default block asks for Hermes-style calls
        # Few templates know a `developer` role (OpenAI's newer name for system, which Codex
        # sends); the others would write it as a literal turn of that name.
        self.knows_developer = isinstance(template, str) and "developer" in template
        # apply_chat_template's own parameters (tokenize, chat_template, add_generation_prompt, ...):
        # names a request's chat_template_kwargs may not set, only the template's variables.
        parameters = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
        # and the names transformers' renderer takes its own arguments by (issue 65: a 500 before)
        self.reserved = frozenset(parameters | {"messages", "conversation", "conversations", "self"})
        vocab = tokenizer.get_vocab()
        found = [(text, token) for text, token in REASONING_TAGS if token[0] in vocab and token[1] in vocab]
        self.think, self.think_tokens = found[0] if found else REASONING_TAGS[0]
        self.reasoning = bool(found)
        self.tool_tokens = self._tool_tokens()
        tags = tuple(self.single_token(tag) for tag in self.think_tokens) if self.reasoning else ()
        self.think_tags: tuple[int, int] | None = tags if tags and None not in tags else None

    def plan(self, chat: ChatRequest) -> ChatPlan:
        use = chat.tools
        kwargs = dict(chat.template_kwargs)
        if taken := sorted(self.reserved & set(kwargs)):
            raise ChatError(
                f"chat_template_kwargs may not set {', '.join(taken)}: the server renders the chat",
                "chat_template_kwargs",
            )
        if chat.thinking is not None:
            kwargs.setdefault("enable_thinking", chat.thinking)
        thinking = kwargs.get("enable_thinking")  # asked for, or not, or None: the template's default
        prompt, stop = self.render(chat.messages, [tools.as_function(t) for t in use.tools] if use else None, kwargs)
        grammar = chat.response_format
        if use is not None:
            lazy = use.choice == "auto"
            grammar = GrammarSpec("tool_calls", self.tool_grammar(use.callable, use.parallel, lazy), lazy)
        inside = self.reasoning and prompt.rstrip().endswith(self.think[0])
        return ChatPlan(
            prompt=prompt,
            stop=stop,
            grammar=self.after_thought(grammar, chat.thinking_budget, thinking, inside),
            keep_tokens=self.tool_tokens if use or self.reasoning else (),
            tool_format=self.tool_format,
            tool_names=None if use is None else frozenset(t["name"] for t in use.tools),
            reasoning=self.reasoning,
            thinking=inside,
            thought=(*self.think_tags, inside) if self.think_tags else None,
            custom_names=frozenset(t["name"] for t in use.tools if "custom" in t) if use else frozenset(),
            think=self.think,
        )

    def after_thought(
        self, grammar: GrammarSpec | None, budget: int | None, thinking: bool | None, inside: bool
    ) -> GrammarSpec | None:
        """`grammar` (or free text) after the reply's thought, where the reply may think: the
        budget ends the thought, and the grammar holds from the end of the thought on
        (backends.decoding.grammar.ThinkingGrammar). The reply thinks where the prompt opened <think>.
        It may open <think> itself first thing (Qwen3's template leaves that to the model) where
        thinking was not turned off, and before a grammar that holds from the reply's start (a
        response format, a forced call) only where thinking was asked for: else that grammar
        holds from the first token, as without a thought. Where <think> or </think> is no single
        token, the grammar stays as it is and no budget is kept."""
        tags = self.think_tags
        if tags is None:
            return grammar
        free = grammar is None or grammar.lazy
        may_open = not inside and (thinking is True or (thinking is None and free))
        if not (inside or may_open) or (grammar is None and budget is None):
            return grammar
        plan = {
            "inner": grammar and [grammar.kind, grammar.spec],
            "budget": budget,
            "open": tags[0],
            "close": tags[1],
            "inside": inside,
            "may_open": may_open,
        }
        return GrammarSpec("thinking", json.dumps(plan), lazy=free)

    def render(
        self, messages: list[dict], tool_list: list[dict] | None, kwargs: dict | None = None
    ) -> tuple[str, tuple[str, ...]]:
        """The prompt and its stops: the chat template when there is one, else Phi-2's model-card
        format. Tools (OpenAI's function tools) through the template's own `tools=` where it
        renders them, else with the default tools block (backends.chat.tools)."""
        native = self.has_template and self.template_knows_tools
        if not self.knows_developer:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if tool_list or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = tools.template_messages(messages, tool_list, native, self.tool_format)
        if not self.has_template:
            return phi2_chat_prompt(messages)

        def rendered(messages: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(
                messages,
                # transformers' (and the templates') form of a tool: {"type": "function", "function": {...}}
                tools=[{"type": "function", "function": t} for t in tool_list] if native and tool_list else None,
                tokenize=False,
                add_generation_prompt=True,
                **(kwargs or {}),
            )

        try:
            try:
                return rendered(messages), ()
            except TemplateError:
                # A system turn where the template takes none (Mistral's, Gemma's raise): all
                # system text folded into the one system turn first, as the template allows.
                folded = folded_system(messages)
                if folded == messages:
                    raise
                return rendered(folded), ()
        except TemplateError as exc:  # the template's own refusal (or what a variable made of it)
            raise ChatError(f"the model's chat template refused this chat: {str(exc)[:300]}") from None
        except (TypeError, ValueError) as exc:  # a variable of the request's the template cannot take
            if not kwargs:
                raise
            message = f"the model's chat template cannot take these chat_template_kwargs: {str(exc)[:300]}"
            raise ChatError(message, "chat_template_kwargs") from None

    def single_token(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _tool_tokens(self) -> tuple[tuple[int, str], ...]:
        """The format's tags (and <think>'s) that are single tokens: the text of a reply keeps
        them, where decoding would skip them as special tokens, so that its calls can be parsed."""
        tags = [self.tool_format.open, self.tool_format.close, *self.tool_format.kept]
        if self.reasoning:
            tags += list(self.think_tokens)
        found = ((self.single_token(tag), tag) for tag in tags if tag)
        return tuple((token, tag) for token, tag in found if token is not None)

    def tool_grammar(self, tool_list: list[dict], parallel: bool, lazy: bool) -> str:
        """The `tool_calls` grammar spec (backends.decoding.grammar) for calls to `tool_list` ({name,
        parameters} each, or a custom tool's): the whole reply, or lazy (armed when the model opens
        a call). `custom`: each custom tool's own grammar, which the compile checks alone first
        (its error then names the tool)."""
        format = self.tool_format

        def written(tag: str) -> str:
            # A tag that is one token (llguidance counts every added token as special) may also
            # come spelled out in pieces: the grammar takes either.
            token = self.single_token(tag)
            return json.dumps(tag) if token is None else f"(<[{token}]> | {json.dumps(tag)})"

        tags = {tag: written(tag) for tag in (format.open, format.close, *format.kept) if tag}
        trigger = None
        if lazy:
            token = self.single_token(format.open)
            ids = (token,) if token is not None else ()
            trigger = tools.Trigger(ids, (format.open,), ("{",) if format.bare else ()).to_json()
        ids = {tag: self.single_token(tag) for tag in tags}
        custom = [
            {"tool": t["name"], "lark": tools.custom_lark(t["custom"]["syntax"], t["custom"]["definition"])}
            for t in tool_list
            if t.get("custom", {}).get("syntax", "text") != "text"
        ]
        lark = tools.tool_grammar(format, tool_list, parallel, tags, ids)
        return json.dumps({"lark": lark, "trigger": trigger, **({"custom": custom} if custom else {})})


def folded_system(messages: list[dict]) -> list[dict]:
    """The messages with every system turn's text in one system turn first (Claude Code sends
    system turns mid-conversation), in their order."""
    system = [m for m in messages if m["role"] == "system"]
    if not system or (len(system) == 1 and messages[0]["role"] == "system"):
        return messages
    first = {**system[0], "content": "\n\n".join(m["content"] for m in system if m["content"])}
    return [first, *(m for m in messages if m["role"] != "system")]


# Base Phi-2 has no chat template; its model card's chat format is a dialogue of Alice (the
# user) and Bob (the model). Generation starts after "Bob:" and stops before the model writes
# Alice's next turn itself.
USER_NAME, ASSISTANT_NAME = "Alice", "Bob"


def phi2_chat_prompt(messages: list[dict]) -> tuple[str, tuple[str, ...]]:
    lines = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role in ("system", "developer"):
            lines.append(content)
        else:
            lines.append(f"{USER_NAME if role == 'user' else ASSISTANT_NAME}: {content}")
    lines.append(f"{ASSISTANT_NAME}:")
    return "\n".join(lines), (f"\n{USER_NAME}:",)
