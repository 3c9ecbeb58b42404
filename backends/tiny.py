"""Write a tiny Phi checkpoint, fully offline and deterministic, in a few seconds.

The tiny model has Phi-2's architecture (model_type "phi", partial rotary embeddings,
gelu_new, untied head with a bias) at toy size, and a byte-level BPE tokenizer trained with
`tokenizers`. Its weights start random and get a couple of seconds of training on the dozen
lines of CORPUS below, until it has memorized them: then greedy decoding finishes known
lines and stops at end-of-text, so the server's stop, end-of-text and multi-byte paths are
reachable on a model this small. Beyond those lines its output is gibberish. It exists so
that the server, the tests and `make demo` run the real loading and generation code where
Phi-2's weights cannot be downloaded.

Usage: python -m backends.tiny DIR
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
# factors whose long half starts inside the context (Phi-3). Windows and longrope's switch are
# short, so short prompts cross them.
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
}


def write_tiny_family(path: str | Path, family: str, tokenizer_from: str | Path) -> Path:
    """A tiny checkpoint of `family` (TINY_FAMILIES) with random weights and the tiny
    checkpoint's tokenizer (from `tokenizer_from`), written to `path`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config_class, options = TINY_FAMILIES[family]
    settings = {**FAMILY_COMMON, **options}
    config = getattr(transformers, config_class)(
        **settings, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None, torch_dtype="float32"
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).eval()
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
