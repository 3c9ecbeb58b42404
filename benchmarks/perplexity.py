"""Perplexity on real text (issue 54): the quality each weight option costs on PHI2_MODEL, beside
llama.cpp's llama-perplexity on the same file and the same text (bench.py --perplexity).

The method is llama-perplexity's, so its numbers stand beside ours: the text's ids are cut into
windows of --perplexity-context ids (512: llama-perplexity's default -c, and it is given the same
-c), the last partial window left out; each window goes through the model alone (a fresh cache);
in each, the ids after its first half are scored, from position context/2 + 1 on (context/2 - 1
of them), each given every id before it in the window. Perplexity is exp of the mean negative
log-likelihood over every scored id; the ± is llama-perplexity's: perplexity x the standard error
of that mean. Where the GGUF file says to add BOS, llama-perplexity puts it first in the text and
in place of each window's first id: so does `windows` here.

The logits are the server's own: on Torch the general decoder's pass over a prompt
(BatchedDecoder.logits_after, every position), on MLX the pass that prompt logprobs take
(MlxBackend.start); a token's logprob is what the server reports (the log-softmax, in float32,
over the whole vocabulary: backends/torch/logprobs.py, backends/mlx/logprobs.py).
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"

# (label, PHI2_QUANTIZE, PHI2_DTYPE) on Torch: full precision, the weight-only and w8a8 methods in
# the dtype each is served in (as --quant-quality), llama.cpp's block types quantized from the
# dequantized weights, and the GGUF file's own blocks (the default: PHI2_QUANTIZE unset).
TORCH_ROWS = (
    ("float32", "none", "float32"),
    ("bfloat16", "none", "bfloat16"),
    ("int8", "int8", "bfloat16"),
    ("int4", "int4", "bfloat16"),
    ("w8a8", "w8a8", "float32"),
    ("q8_0", "q8_0", "auto"),
    ("q4_0", "q4_0", "auto"),
    ("as stored", "", "auto"),
)
# On MLX: what it loads (a GGUF file's converted checkpoint, float32) and mlx-lm's 8 and 4 bits.
MLX_ROWS = (("as loaded", ""), ("8 bits", "8"), ("4 bits", "4"))
# llama.cpp: the file itself, and llama-quantize's requantizations of it (--allow-requantize).
LLAMA_ROWS = ("file", "q8_0", "q4_0")

Scorer = Callable[[list[int]], list[float]]


def windows(ids: list[int], context: int, bos: int | None = None) -> list[list[int]]:
    """The whole windows of `context` ids llama-perplexity scores, BOS first in each if given."""
    cut = [ids[i * context : (i + 1) * context] for i in range(len(ids) // context)]
    return [[bos, *w[1:]] for w in cut] if bos is not None else cut


def window_nll(score: Scorer, window: list[int]) -> list[float]:
    """The negative log-likelihood of each id of the window's second half (from context/2 + 1)."""
    logprobs = score(window)  # of window[k + 1] after window[: k + 1], k = 0 .. len - 2
    return [-x for x in logprobs[len(window) // 2 :]]


def summary(nll: list[list[float]]) -> dict:
    """Perplexity of the scored ids of `nll`'s windows, and llama-perplexity's ± of it."""
    flat = [x for w in nll for x in w]
    mean = sum(flat) / len(flat)
    spread = sum(x * x for x in flat) / len(flat) - mean * mean
    error = math.sqrt(spread / (len(flat) - 1)) if spread > 0 else 0.0
    return {"perplexity": math.exp(mean), "plus_minus": math.exp(mean) * error, "tokens": len(flat)}


def perplexity(score: Scorer, ids: list[int], context: int, bos: int | None = None, limit: int = 0) -> dict:
    """Perplexity of the first `limit` windows (0: all), and each window's NLLs (`nll`)."""
    cut = windows(ids, context, bos)
    nll = [window_nll(score, w) for w in cut[: limit or len(cut)]]
    return {**summary(nll), "windows": len(nll), "nll": nll}


def text_ids(backend, text: str, bos: int | None) -> list[int]:
    """The text's ids as the server encodes a prompt, BOS first if the file says to add it."""
    return ([bos] if bos is not None else []) + backend.encode(text)


def torch_scorer(backend) -> Scorer:
    """Logprobs of each next id through the Torch general decoder's pass over the window."""
    from backends.torch.decoder import BatchedDecoder
    from backends.torch.logprobs import token_logprobs

    decoder = BatchedDecoder(backend.decoder_weights, 1)

    def score(window: list[int]) -> list[float]:
        logits = decoder.logits_after(window, every_position=True)
        return [t.logprob for t in token_logprobs(logits[:-1], window[1:], 0)]

    return score


def mlx_scorer(backend) -> Scorer:
    """Logprobs of each next id as MLX's prompt logprobs compute them."""
    from backends.contract import Sampling, Sequence

    def score(window: list[int]) -> list[float]:
        _, _, scores = backend.start(Sequence(0, window, Sampling(), 1, prompt_logprobs=0), None)
        return [t.logprob for t in scores]

    return score


def gguf_facts(file: Path) -> dict:
    """What llama-perplexity reads of a GGUF file: add BOS or not, the BOS id, the tensor types."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(file)

    def value(key: str):
        field = reader.get_field(key)
        return None if field is None else field.parts[field.data[0]][0]

    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {
        "add_bos": bool(value("tokenizer.ggml.add_bos_token")),
        "bos": int(value("tokenizer.ggml.bos_token_id")),
        "types": ", ".join(f"{name} x{n}" for name, n in types.most_common()),
    }


def llama_ids(tree: Path, file: Path, text: str, log: Path) -> list[int]:
    """The text's ids as llama-perplexity makes them (common_tokenize: special tokens added as
    the file says, special-token text not parsed), through llama-server's /tokenize."""
    import aiohttp

    from benchmarks.llama_cpp import start_llama

    server = start_llama(tree, file, 1, 512, 300, log)

    async def tokenize() -> list[int]:
        body = {"content": text, "add_special": True, "parse_special": False}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/tokenize", json=body) as response:
                return (await response.json())["tokens"]

    try:
        return asyncio.run(tokenize())
    finally:
        server.stop()


FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
RUNNING = re.compile(r"\[(\d+)\]([0-9.]+),")


def llama_perplexity(tree: Path, file: Path, text: Path, context: int, threads: int, log: Path) -> dict:
    """llama-perplexity's final estimate and its running perplexity after each window."""
    command = [str(tree / "build/bin/llama-perplexity"), "-m", str(file), "-f", str(text)]
    command += ["-c", str(context), "-t", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    output = done.stdout + done.stderr
    with open(log, "a") as out:
        out.write(" ".join(command) + "\n" + output)
    final = FINAL.search(output)
    if done.returncode or not final:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}); its output is in {log}")
    running = {int(i): float(p) for i, p in RUNNING.findall(output)}
    return {"perplexity": float(final[1]), "plus_minus": float(final[2]), "running": running}


def row_line(row: dict, reference: dict | None) -> str:
    whole = f"{row['perplexity']:.3f} ± {row['plus_minus']:.3f}" if row.get("perplexity") else "—"
    change = f"{row['perplexity'] / reference['perplexity'] - 1:+.1%}" if reference and row.get("perplexity") else "—"
    head = f"{row['first_perplexity']:.3f}" if row.get("first_perplexity") else "—"
    return (
        f"| {row['runtime']} | {row['weights']} | {row['dtype']} | {whole} | {change} | {head} | {row['seconds']:.0f} |"
    )


def perplexity_table(args) -> list[dict]:
    """Every row of the table: Torch's options, MLX's (its first --perplexity-mlx-windows windows:
    the MLX CPU build is slow), llama.cpp's; each row's perplexity over those first windows too."""
    import torch

    from backends.choose import load_backend
    from backends.contract import LoadOptions
    from backends.files.models import gguf_file

    spec = os.environ.get("PHI2_MODEL", "")
    source = gguf_file(spec)
    if not source:
        raise SystemExit("bench.py --perplexity: PHI2_MODEL must name a GGUF file (e.g. `make demo`'s)")
    context, first = args.perplexity_context, args.perplexity_mlx_windows
    text_file = Path(args.perplexity_text)
    text = text_file.read_text()
    facts = gguf_facts(source)
    bos = facts["bos"] if facts["add_bos"] else None
    work = Path(args.llama_work or tempfile.mkdtemp(prefix="phi2-perplexity-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "llama.log"
    tree = Path(args.perplexity).resolve() if args.perplexity else None
    rows: list[dict] = []
    reference = None
    ids = None
    chosen = {label.strip() for label in getattr(args, "perplexity_rows", "").split(",") if label.strip()}

    def wanted(label: str) -> bool:
        return not chosen or label in chosen

    def report(row: dict) -> None:
        rows.append(row)
        print(row_line(row, reference), flush=True)

    for label, quantize, dtype in [row for row in TORCH_ROWS if wanted(row[0])]:
        # every row is loaded for its quality, faster than the float default here or not
        options = LoadOptions(
            model=spec, dtype=dtype, quantize=quantize, warmup=False, quantized_cache=False, speed_check=False
        )
        backend = load_backend("torch", options)
        if ids is None:
            ids = text_ids(backend, text, bos)
            print(
                f"[text] {text_file.name}: {len(text)} characters, {len(ids)} ids; {len(ids) // context} windows "
                f"of {context}, {context - context // 2 - 1} ids scored in each; GGUF add_bos={facts['add_bos']} "
                f"(BOS {'first in each window' if bos is not None else 'nowhere'}); file: {facts['types']}",
                file=sys.stderr,
                flush=True,
            )
            if tree:
                theirs = llama_ids(tree, source, text, log)
                same = theirs == ids
                differ = next((i for i, (a, b) in enumerate(zip(theirs, ids, strict=False)) if a != b), None)
                print(
                    f"[text] llama.cpp's ids: {len(theirs)}; the same as ours: {same}"
                    + ("" if same else f" (first difference at {differ})"),
                    file=sys.stderr,
                    flush=True,
                )
        started = time.perf_counter()
        measured = perplexity(torch_scorer(backend), ids, context, bos)
        quantization = backend.info.quantization
        weights = label
        if quantize == "" and quantization:
            weights = f"as stored ({', '.join(quantization.get('types', []))} blocks)"
        row = {
            "runtime": "torch",
            "weights": weights,
            "PHI2_QUANTIZE": quantize,
            "dtype": backend.info.dtype,
            **measured,
            "first_perplexity": summary(measured["nll"][:first])["perplexity"] if first else None,
            "seconds": time.perf_counter() - started,
        }
        reference = reference or row
        report(row)
        del backend
        gc.collect()
    for label, quantize in [row for row in MLX_ROWS if wanted(row[0])] if first else ():
        backend = load_backend("mlx", LoadOptions(model=spec, quantize=quantize, warmup=False))
        if text_ids(backend, text, bos) != ids:
            raise RuntimeError("MLX's tokenizer gives other ids than Torch's for the text")
        started = time.perf_counter()
        measured = perplexity(mlx_scorer(backend), ids, context, bos, limit=first)
        row = {"runtime": "mlx", "weights": label, "PHI2_QUANTIZE": quantize, "dtype": backend.info.dtype}
        row |= {"nll": measured["nll"], "first_perplexity": measured["perplexity"]}
        row |= {"seconds": time.perf_counter() - started}
        report(row)
        del backend
        gc.collect()
    for kind in [kind for kind in LLAMA_ROWS if wanted(kind)] if tree else ():
        from benchmarks.llama_cpp import requantized

        file = requantized(tree, source, kind, work)
        started = time.perf_counter()
        measured = llama_perplexity(tree, file, text_file, context, torch.get_num_threads(), log)
        weights = f"{'the file' if kind == 'file' else kind.upper() + ' (llama-quantize)'}: {gguf_facts(file)['types']}"
        row = {"runtime": "llama.cpp", "weights": weights, "dtype": "ggml CPU", **measured}
        head = measured["running"].get(first) if first else None
        row |= {"first_perplexity": head, "seconds": time.perf_counter() - started}
        report(row)
    return rows
