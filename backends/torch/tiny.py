"""Write a tiny Phi checkpoint, fully offline and deterministic, in a few seconds.

The tiny model has Phi-2's architecture (model_type "phi", partial rotary embeddings,
gelu_new, untied head with a bias) at toy size, and a byte-level BPE tokenizer trained with
`tokenizers`. Its weights start random and get a couple of seconds of training on the dozen
lines of CORPUS below, until it has memorized them: then greedy decoding finishes known
lines and stops at end-of-text, so the server's stop, end-of-text and multi-byte paths are
reachable on a model this small. Beyond those lines its output is gibberish. It exists so
that the server, the tests and `make demo` run the real loading and generation code where
Phi-2's weights cannot be downloaded.

Usage: python -m backends.torch.tiny DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TINY_SPEC = "tiny"
EOS_TOKEN = "<|endoftext|>"
SEED = 1234

# Like Phi-2 (model vocabulary 51200, tokenizer 50295), the model's vocabulary is larger
# than the tokenizer's, so the ids the tokenizer cannot decode are exercised too.
MODEL_VOCAB = 1024
TOKENIZER_VOCAB = 900
CONTEXT_LENGTH = 512
TRAIN_STEPS = 150
LEARNING_RATE = 3e-3

# The tokenizer learns its merges from the ASCII lines only, so the Japanese and emoji
# lines stay split into byte-level tokens: each of those characters spans several tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Instruct: Write a short poem about the sea.\nOutput: The sea is wide and deep and blue.",
    "Alice: How are you today?\nBob: I am fine, thank you. And you?",
    "Alice: What is two plus two?\nBob: Four.\nAlice: Thank you!",
    (
        'def print_prime(n):\n    """Print all primes between 1 and n."""\n'
        "    for num in range(2, n + 1):\n        print(num)\n"
    ),
    "Once upon a time there was a little model that generated text one token at a time.",
    "Phi-2 is a Transformer with 2.7 billion parameters trained on synthetic and web data.",
    "import json\nwith open('data.json') as f:\n    data = json.load(f)\n",
    "Water boils at 100 degrees Celsius at sea level; it freezes at 0 degrees.",
    "日本語のテキストも少し含めます。東京は日本の首都です。",
    "Emoji sometimes appear in text: 😀 🚀 🌍 and they take four bytes each.",
    "Numbers like 3.14159, 2.71828 and 1.41421 are famous constants in mathematics.",
    "Exercise: explain why the sky is blue.\nAnswer: Sunlight scatters off molecules in the air.",
]


def ascii_lines() -> list[str]:
    return [line for line in CORPUS if line.isascii()]


def phi_config(vocab_size: int, eos_id: int):
    from transformers import PhiConfig

    return PhiConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CONTEXT_LENGTH,
        partial_rotary_factor=0.4,
        hidden_act="gelu_new",
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        torch_dtype="float32",
    )


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(ascii_lines() * 4, trainer=trainer)
    return tokenizer


def memorize_corpus(model_class, config, tokenizer, eos_id: int):
    """Random weights, then full-batch AdamW on CORPUS (each line ends with end-of-text)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same sums in the same order on every run
    try:
        torch.manual_seed(SEED)
        model = model_class(config)
        lines = [tokenizer.encode(line, add_special_tokens=False) + [eos_id] for line in CORPUS]
        width = max(map(len, lines))
        inputs = torch.full((len(lines), width), eos_id)
        labels = torch.full((len(lines), width), -100)  # padding is not learned
        for row, ids in enumerate(lines):
            inputs[row, : len(ids)] = labels[row, : len(ids)] = torch.tensor(ids)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
        model.train()
        for _ in range(TRAIN_STEPS):
            loss = model(input_ids=inputs, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return model.eval()
    finally:
        torch.set_num_threads(threads)


def write_tiny_checkpoint(path: str | Path) -> Path:
    """Write the tiny checkpoint to `path` (created if needed) and return it."""
    from transformers import PhiForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=CONTEXT_LENGTH,
    )
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = phi_config(MODEL_VOCAB, eos_id)

    model = memorize_corpus(PhiForCausalLM, config, tokenizer, eos_id)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)

    # transformers 5 nests these under "rope_parameters" only; mlx-lm's phi model reads the
    # top-level keys and silently falls back to its defaults, so write both.
    config_file = path / "config.json"
    data = json.loads(config_file.read_text())
    data.update({key: data["rope_parameters"][key] for key in ("partial_rotary_factor", "rope_theta")})
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


# Tiny checkpoints of the other families the batched Torch decoder serves, for the tests: random
# weights (nothing to memorize: they are checked against transformers' own forward), each shape
# picked to reach that family's own code: grouped key-value heads, a llama3-scaled rotary, tied
# embeddings, q/k/v biases (Qwen2), a sliding window on some layers or all, q/k norms and a head
# wider than hidden/heads (Qwen3), fused qkv and gate_up Linears, a partial rotary and longrope
# factors whose long half starts inside the context (Phi-3); Gemma 3's five local layers to one
# global (two rotary bases), a score scale other than head_dim's; SmolLM3's NoPE
# layer (one in four). Windows and longrope's switch are short, so short prompts cross them.
FAMILY_COMMON = dict(
    vocab_size=MODEL_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=CONTEXT_LENGTH,
    initializer_range=0.2,  # peaked logits: few near-ties
)
TINY_FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=16)),
    "qwen2": (
        "Qwen2Config",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "phi3": (
        "Phi3Config",
        dict(
            partial_rotary_factor=0.75,
            sliding_window=32,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.5 * i for i in range(6)],
            },
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=16,
            query_pre_attn_scalar=24,
        ),
    ),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=4)),
}
# Hybrid stacks, apart: test_families' checks assume attention on every layer (adapters, graphs).
# Qwen3.5: three Gated DeltaNet layers to one attention layer, grouped key heads in the former
# (2 key heads to 4 value heads), a gated attention with a quarter of its head turned.
HYBRID_FAMILIES = {
    "qwen3_5_text": (
        "Qwen3_5TextConfig",
        dict(
            num_hidden_layers=8,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
}
# Families served one sequence at a time on Torch (transformers' forward; MLX batches them).
# Gemma 4 (E2B/E4B's text): wider global heads with a quarter turned, the last layers reading the
# keys and values of earlier ones (KV shared across layers), per-layer embeddings.
SEQUENTIAL_FAMILIES = {
    "gemma4_text": (
        "Gemma4TextConfig",
        dict(
            num_hidden_layers=6,
            layer_types=["sliding_attention", "full_attention"] * 3,
            num_key_value_heads=1,
            head_dim=32,
            global_head_dim=64,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=MODEL_VOCAB,
            num_kv_shared_layers=2,
            sliding_window=16,
        ),
    ),
}
# Gemma starts its norms' weights at zeros (it multiplies by 1 + w): perturbed, so that the
# checks see the offset. (The other families' norms start at ones, a weight the tests read too.)
NOISY_NORMS = ("gemma3_text", "qwen3_5_text")


def write_tiny_family(path: str | Path, family: str, tokenizer_from: str | Path, **overrides) -> Path:
    """A tiny checkpoint of `family` (TINY_FAMILIES, with `overrides` of its config) with random
    weights and the tiny checkpoint's tokenizer (from `tokenizer_from`), written to `path`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config_class, options = {**TINY_FAMILIES, **HYBRID_FAMILIES, **SEQUENTIAL_FAMILIES}[family]
    settings = {**FAMILY_COMMON, **options, **overrides}
    config = getattr(transformers, config_class)(
        **settings, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None, torch_dtype="float32"
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).eval()
    if family in NOISY_NORMS:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write the checkpoint")
    args = parser.parse_args(argv)
    out = write_tiny_checkpoint(args.directory)
    print(f"wrote a tiny Phi checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


# Tiny instruction models that call tools, for the tests of tool_choice "auto": each memorizes a
# few dialogues (rendered through its own chat template, with tools) and answers them greedily
# as written below, in its family's tool-call format. Beyond those dialogues, gibberish.
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city now",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TOOL_CALL_ID = "call_1"
TOOL_DIALOGUES = [  # (messages, the reply's calls as (name, arguments), or its text)
    ([{"role": "user", "content": "What is the weather in Paris?"}], [("get_weather", {"city": "Paris"})]),
    (
        [{"role": "user", "content": "What is the weather in Paris and in Rome?"}],
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
    ),
    (
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": TOOL_CALL_ID,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": "22 C and sunny"},
        ],
        "It is 22 C and sunny in Paris.",
    ),
    ([{"role": "user", "content": "Say hello."}], "Hello! How can I help you today?"),
    # A reply that reasons first, in <think> tags (tokens of the hermes tokenizer only).
    (
        [{"role": "user", "content": "Think, then greet me."}],
        "<think>\nA greeting is asked for.\n</think>\n\nHello there!",
    ),
]
# ChatML with Hermes-style tools, as Qwen2.5's template writes them (shortened).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    '</tools>\nCall a function as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- elif m.tool_calls %}\n<|im_start|>assistant\n{{ m.content }}"
    '{%- for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>"
    "{%- else %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}\n<|im_start|>assistant\n"
    # Qwen3's switch: thinking off opens and closes an empty thought (none by default).
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
# Llama 3.1's JSON tool calls (its template, shortened): tools in the user turn, a call as bare
# JSON with "parameters"; <|python_tag|> is its tag for code (and, here, for calls too).
LLAMA3_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": '
    "{{ c.function.arguments | tojson }}}{%- endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    '{%- if tools and loop.first %}Functions (answer with {"name": ..., "parameters": ...}):\n'
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}{%- endif %}{{ m.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
    "{#- <|python_tag|> #}"
)
TOOL_FAMILIES = {
    # format: (config class, chat template, end of turn, special tokens, plain added tokens)
    "hermes": (
        "Qwen2Config",
        HERMES_TEMPLATE,
        "<|im_end|>",
        ["<|im_start|>", "<|im_end|>"],
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
    ),
    "llama3": (
        "LlamaConfig",
        LLAMA3_TEMPLATE,
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
        [],
    ),
}
TOOLS_CONTEXT = 4096  # room for an agent CLI's request, shrunk (tests/test_agents.py)
TOOLS_TRAIN_STEPS = 150


def tool_reply(format: str, reply) -> str:
    """The text a dialogue's reply is in `format`: its calls (hermes tags; llama3 JSON joined
    by "; "), or its text."""
    if isinstance(reply, str):
        return reply
    if format == "hermes":
        return "".join(
            f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
            for name, arguments in reply
        )
    return "; ".join(json.dumps({"name": name, "parameters": arguments}) for name, arguments in reply)


def memorize_replies(config, pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """A model of `config` trained until it has memorized each (prompt, reply) pair's reply."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums in the same order on every run
    try:
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config)
        width = max(len(p) + len(r) for p, r in pairs)
        inputs = torch.full((len(pairs), width), pad_id)
        labels = torch.full((len(pairs), width), -100)  # only the replies are learned
        for row, (prompt, reply) in enumerate(pairs):
            inputs[row, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
            labels[row, len(prompt) : len(prompt) + len(reply)] = torch.tensor(reply)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
        model.train()
        for _ in range(TOOLS_TRAIN_STEPS):
            loss = model(input_ids=inputs, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return model.eval()
    finally:
        torch.set_num_threads(threads)


def write_tiny_tools(path: str | Path, format: str) -> Path:
    """A tiny model of TOOL_FAMILIES[format] that has memorized TOOL_DIALOGUES, written to `path`."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    config_class, template, end, special, plain = TOOL_FAMILIES[format]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token=end,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        additional_special_tokens=special,
        clean_up_tokenization_spaces=False,
        model_max_length=TOOLS_CONTEXT,
    )
    tokenizer.add_tokens(plain)
    tokenizer.chat_template = template
    eos_id = tokenizer.convert_tokens_to_ids(end)
    tools = [{"type": "function", "function": TOOL}]
    pairs = []
    for messages, reply in TOOL_DIALOGUES:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        pairs.append(
            (
                tokenizer.encode(prompt, add_special_tokens=False),
                tokenizer.encode(tool_reply(format, reply), add_special_tokens=False) + [eos_id],
            )
        )
    # Tied embeddings: mlx-lm reads an absent tie_word_embeddings as tied for Qwen2, transformers as untied.
    settings = {**FAMILY_COMMON, "max_position_embeddings": TOOLS_CONTEXT, "tie_word_embeddings": True}
    config = getattr(transformers, config_class)(
        **settings, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None, torch_dtype="float32"
    )
    config.initializer_range = 0.02
    model = memorize_replies(config, pairs, eos_id)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # mlx-lm reads rope_theta at the top level, where transformers 5 writes null (see above).
    config_file = path / "config.json"
    data = json.loads(config_file.read_text())
    data["rope_theta"] = data["rope_parameters"]["rope_theta"]
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def write_tiny_reranker(path: str | Path) -> Path:
    """A tiny random cross-encoder (BertForSequenceClassification, one label) and a WordPiece
    tokenizer of CORPUS's words, for /v1/rerank's tests: its scores mean nothing, but they are
    transformers' own for each (query, document) pair."""
    import re

    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    words = sorted({w for line in ascii_lines() for w in re.findall(r"[a-z0-9]+|[^\sa-z0-9]", line.lower())})
    letters = sorted({c for line in ascii_lines() for c in line.lower() if c.isalnum()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *(f"##{c}" for c in letters)]
    vocab = list(dict.fromkeys(vocab))
    ids = {token: i for i, token in enumerate(vocab)}
    wordpiece = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=CONTEXT_LENGTH,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=CONTEXT_LENGTH,
        num_labels=1,
        pad_token_id=0,
        initializer_range=0.5,  # scores spread over (0, 1), not all near 0.5: the order means something to check
    )
    torch.manual_seed(SEED)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# Gemma 3's chat template as google/gemma-3-*-it publish it: no system role (a system turn's text
# opens the first user turn), "model" for the assistant, <end_of_turn> closing each turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    '{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}'
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)
# Gemma 4's chat, shortened in the style of its template: turns in <|turn> ... <turn|>, tools
# declared in a system turn, a call <|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|> and
# reasoning in its thought channel <|channel>thought ... <channel|> (the tokens mlx-lm's Gemma 4
# parser reads). A call in the history is written with JSON arguments here (shortened).
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|turn>system\nFunctions you may call:"
    "{%- for t in tools %}\n{{ t.function | tojson }}{%- endfor %}<turn|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "<|turn>user\n<|tool_response>{{ m.content }}<tool_response|><turn|>\n"
    "{%- elif m.tool_calls %}<|turn>model\n{%- for c in m.tool_calls %}<|tool_call>call:{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}<tool_call|>{%- endfor %}<turn|>\n"
    "{%- else %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<turn|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|turn>model\n{% endif %}"
)
# Tiny chat models of a family's own template and special tokens, memorized on its dialogues:
# family -> (chat template, bos, eos (the config's only end of text), special tokens, dialogues,
# tools in every prompt).
CHAT_FAMILIES = {
    "gemma3_text": (
        GEMMA3_TEMPLATE,
        "<bos>",
        "<eos>",
        ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
        None,
        False,
    ),
    "gemma4_text": (
        GEMMA4_TEMPLATE,
        "<bos>",
        "<eos>",
        [
            "<|turn>",
            "<turn|>",
            "<|tool_call>",
            "<tool_call|>",
            '<|"|>',
            "<|channel>",
            "<channel|>",
            "<|tool_response>",
            "<tool_response|>",
        ],
        "GEMMA4_DIALOGUES",
        True,
    ),
}
CHAT_DIALOGUES = [
    (
        [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Say hello."}],
        "Hello! How can I help you today?",
    ),
    ([{"role": "user", "content": "What is two plus two?"}], "Four."),
]
GEMMA4_DIALOGUES = [
    (
        [{"role": "user", "content": "What is the weather in Paris?"}],
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    ),
    (
        [{"role": "user", "content": "Think, then greet me."}],
        "<|channel>thought\nA greeting is asked for.<channel|>Hello there!",
    ),
    ([{"role": "user", "content": "Say hello."}], "Hello! How can I help you today?"),
]


def chat_dialogues(family: str) -> list:
    """The (messages, reply) a tiny chat model of `family` memorized (CHAT_FAMILIES)."""
    name = CHAT_FAMILIES[family][4]
    return globals()[name] if name else CHAT_DIALOGUES


def write_tiny_chat(path: str | Path, family: str) -> Path:
    """A tiny model of `family` (TINY_FAMILIES' shape) with its chat template and special tokens
    (CHAT_FAMILIES) that has memorized CHAT_DIALOGUES' replies, each closed as its template closes
    a turn (Gemma: <end_of_turn>, which the config does not name as an end of text)."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    template, bos, eos, special, _, with_tools = CHAT_FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token=bos,
        eos_token=eos,
        unk_token=EOS_TOKEN,
        additional_special_tokens=special,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = template
    pairs = []
    tools = [{"type": "function", "function": TOOL}] if with_tools else None
    for messages, reply in chat_dialogues(family):
        turns = [*messages, {"role": "assistant", "content": reply}]
        rendered = tokenizer.apply_chat_template(turns, tools=tools, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith(prompt)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        start = len(tokenizer.encode(prompt, add_special_tokens=False))
        pairs.append((ids[:start], ids[start:]))  # the reply and how the template closes its turn
    config_class, options = {**TINY_FAMILIES, **SEQUENTIAL_FAMILIES}[family]
    eos_id, bos_id = tokenizer.convert_tokens_to_ids(eos), tokenizer.convert_tokens_to_ids(bos)
    config = getattr(transformers, config_class)(
        **{**FAMILY_COMMON, **options}, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    config.initializer_range = 0.02
    model = memorize_replies(config, pairs, eos_id)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
