"""Build a Phi-2-like HF fast tokenizer from the p50k_base tiktoken cache on disk.
p50k_base ranks 0..50255 are byte-identical to GPT-2 / r50k_base (Phi-2 = CodeGen = GPT-2 BPE + added
whitespace tokens). Merges are recovered from ranks the standard way (TikTokenConverter-style)."""

import base64
import glob
import json
import os
import re
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

SRC = glob.glob(
    ".venv/lib/python3*/site-packages/litellm/litellm_core_utils/tokenizers/ec7223a39ce59f226a68acc30dc1af2788490e15"
)[0]  # sha1(p50k_base.tiktoken URL): litellm ships it
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "phi2-tokenizer")

ranks = {}
for line in open(SRC, "rb"):
    tok, r = line.split()
    r = int(r)
    if r < 50256:  # r50k/GPT-2 part only (p50k's 50257.. are its own space merges)
        ranks[base64.b64decode(tok)] = r
assert len(ranks) == 50256


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=False))


B2U = bytes_to_unicode()


def enc(b):
    return "".join(B2U[x] for x in b)


def bpe(token: bytes, max_rank: int):
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2 :]


vocab = {enc(t): r for t, r in ranks.items()}
merges = []
for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
    if len(t) == 1:
        continue
    p = bpe(t, r)
    assert len(p) == 2, (t, p)
    merges.append((enc(p[0]), enc(p[1])))
vocab["<|endoftext|>"] = 50256

tk = Tokenizer(
    models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
)
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tk.decoder = decoders.ByteLevel()
tk.post_processor = processors.ByteLevel(trim_offsets=False)
tk.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
# CodeGen / Phi-2 added tokens: 31..2 spaces -> 50257..50286, 9..2 tabs -> 50287..50294
extra = [" " * n for n in range(31, 1, -1)] + ["\t" * n for n in range(9, 1, -1)]
tk.add_tokens([AddedToken(s, special=False, normalized=True) for s in extra])
assert tk.get_vocab_size(with_added_tokens=True) == 50295, tk.get_vocab_size(with_added_tokens=True)
assert tk.token_to_id(" " * 31) == 50257 and tk.token_to_id("\t\t") == 50294

os.makedirs(OUT, exist_ok=True)
tk.save(os.path.join(OUT, "tokenizer.json"))
json.dump(
    {
        "tokenizer_class": "CodeGenTokenizer",
        "model_max_length": 2048,
        "add_prefix_space": False,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
    },
    open(os.path.join(OUT, "tokenizer_config.json"), "w"),
    indent=1,
)
json.dump(
    {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
    open(os.path.join(OUT, "special_tokens_map.json"), "w"),
    indent=1,
)

# sanity: must match tiktoken r50k semantics on text without >=2-space runs
# (tiktoken is imported here, not at the top: the tokenizer above is saved even without it)
import tiktoken  # noqa: E402

te = tiktoken.Encoding(
    "p50k_trunc",
    pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    mergeable_ranks=ranks,
    special_tokens={"<|endoftext|>": 50256},
)
txt = (
    open("/usr/lib/python3.11/json/__init__.py").read()
    if os.path.exists("/usr/lib/python3.11/json/__init__.py")
    else open(json.__file__).read()
)
txt = re.sub(r"[ \t]{2,}", " ", txt)
a = tk.encode(txt).ids
b = te.encode(txt)
print("ids match tiktoken:", a == b, len(a))
if a != b:
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    print(i, a[i - 3 : i + 5], b[i - 3 : i + 5], repr(tk.decode(a[i - 3 : i + 5])))
print("demo:", tk.encode('{"name": "Al",\n    "age": 3}<|endoftext|>').ids)
print("saved", OUT, tk.get_vocab_size(with_added_tokens=True))
