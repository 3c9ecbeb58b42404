"""The Triton kernels (backends/torch/cuda/triton_*.py) on a CUDA machine: greedy ids against the
unfused step, the attention kernels' launch shapes against the unfused attention, the whole
decode step against the eager and compiled unfused steps, and prefill timing, in the same run
as the memory bandwidth.

    python3 tests/gpu/kernels.py --out results/     # a few minutes on one H200

Not part of `make test` (CI has no GPU). tests/gpu/check.py measures the server end to end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.torch.cuda import triton_attention, triton_common  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

RESULTS: dict = {}


def say(*parts) -> None:
    print(*parts, flush=True)


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph (as the server's step is)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / reps)
    return sorted(times)[2]


def bandwidths() -> dict:
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = graph_time(lambda: dst.copy_(src), reps=5)
    total = torch.empty((), device="cuda", dtype=torch.float32)
    read = graph_time(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=total), reps=5)
    nbytes = src.numel() * 2
    src = dst = None  # freed before empty_cache; rebound, not deleted: the lambdas above name them
    torch.cuda.empty_cache()
    return {"copy_bytes_s": 2 * nbytes / copy, "read_bytes_s": nbytes / read}


def attention_case(rows: int, context: int, layers: int, device: str = "cuda", dtype=torch.bfloat16):
    """Phi-2's decode attention at `rows` x `context`, `layers` deep: (reference, kernel), each
    a function over the layers returning the last layer's attention output [rows, hidden].
    reference is the unfused step's attention (rotary, cache writes, baddbmm, masked softmax,
    bmm over the power-of-two span) on contiguous caches; kernel is triton_attention.attention (split,
    combine) on a paged copy of the same caches, one table row of consecutive pages a row."""
    from backends.torch.cuda.graphs import MIN_LENGTH_BUCKET
    from backends.torch.kv_pages import PAGE
    from backends.torch.network import rope_

    hidden, heads, head_dim, rot, inner = 2560, 32, 80, 32, 10240
    span = max(MIN_LENGTH_BUCKET, triton_pow2(context + 1))
    width = -(-span // PAGE)
    contiguous = [
        (
            torch.randn(rows, heads, width * PAGE, head_dim, device=device, dtype=dtype),
            torch.randn(rows, heads, width * PAGE, head_dim, device=device, dtype=dtype),
        )
        for _ in range(layers)
    ]

    def paged(cache):  # [rows, heads, width * PAGE, d] -> [heads, rows * width, PAGE, d]
        return cache.transpose(0, 1).reshape(heads, rows * width, PAGE, head_dim).clone()

    caches = [(paged(k), paged(v)) for k, v in contiguous]
    table = torch.arange(rows * width, device=device, dtype=torch.int32).view(rows, width)
    y = torch.randn(rows, 3 * hidden + inner, device=device, dtype=dtype)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    b_out = torch.randn(hidden, device=device, dtype=dtype)
    frequencies = torch.rand(rot // 2, device=device)
    angles = torch.arange(width * PAGE, device=device, dtype=torch.float32)[:, None] * frequencies
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(dtype)  # rotate_half's sign folded in
    positions = torch.full((rows,), context, device=device, dtype=torch.long)
    active = torch.ones(rows, device=device, dtype=torch.long)
    every = torch.arange(rows, device=device)
    bias = torch.zeros(rows * heads, 1, span, device=device, dtype=dtype)
    bias[..., context + 1 :] = float("-inf")
    heads_arg = triton_common.Heads(heads, heads, head_dim, rot)

    def reference():
        for k_cache, v_cache in contiguous:
            qkv = y[:, : 3 * hidden].view(rows, 3, heads, head_dim).clone()
            rope_(qkv[:, :2], cos[positions][:, None, None, :], sin[positions][:, None, None, :], rot)
            q, k, v = qkv.unbind(1)
            k_cache[every, :, positions] = k
            v_cache[every, :, positions] = v
            keys = k_cache[:, :, :span].reshape(rows * heads, -1, head_dim)
            values = v_cache[:, :, :span].reshape(rows * heads, -1, head_dim)
            scores = torch.baddbmm(
                bias, q.reshape(rows * heads, 1, head_dim), keys.transpose(1, 2), alpha=head_dim**-0.5
            )
            attention = torch.bmm(torch.softmax(scores, dim=-1), values).view(rows, hidden)
            torch.cat((attention, F.gelu(y[:, 3 * hidden :], approximate="tanh")), dim=-1)
        return attention

    def kernel():
        for k_cache, v_cache in caches:
            mixed, _ = triton_attention.attention(
                y, cos, sin, positions, active, k_cache, v_cache, table, heads_arg, x=x, b_out=b_out, inner=inner
            )
        return mixed[:, :hidden]

    return reference, kernel


def attention_sweep() -> list[dict]:
    """triton_attention.attention's launch shapes (split, combine) against the unfused step's attention, 8
    layers in turn, each shape's output checked against the reference's."""
    defaults = dict(triton_attention.ATTENTION)
    rows_out = []
    configs = [dict(BLOCK_N=bn, num_warps=wp, work=2048) for bn in (16, 32) for wp in (1, 2)] + [
        dict(BLOCK_N=16, num_warps=None, work=2048)
    ]
    for rows, context in ((1, 128), (1, 1044), (64, 128), (64, 1044), (128, 160)):
        layers, heads, head_dim = 8, 32, 80
        reference, kernel = attention_case(rows, context, layers)
        nbytes = rows * context * heads * head_dim * 2 * 2
        expected = reference().float()
        seconds = graph_time(reference) / layers
        rows_out.append(
            {
                "rows": rows,
                "context": context,
                "kernel": "unfused",
                "us": seconds * 1e6,
                "TB_s": nbytes / seconds / 1e12,
            }
        )
        for config in configs:
            triton_attention.ATTENTION.update(config)
            try:
                error = (kernel().float() - expected).abs().max().item()
                seconds = graph_time(kernel) / layers
                rows_out.append(
                    {
                        "rows": rows,
                        "context": context,
                        "kernel": json.dumps(config),
                        "us": seconds * 1e6,
                        "TB_s": nbytes / seconds / 1e12,
                        "splits": triton_attention.splits_for(rows, heads, context + 1),
                        "max_error": error,
                    }
                )
            except Exception as exc:
                rows_out.append(
                    {
                        "rows": rows,
                        "context": context,
                        "kernel": json.dumps(config),
                        "error": f"{type(exc).__name__}: {exc}"[:200],
                    }
                )
        reference = kernel = None  # their caches freed before empty_cache
        torch.cuda.empty_cache()
    triton_attention.ATTENTION.update(defaults)
    return rows_out


def best_attention(rows: list[dict]) -> dict:
    """The launch shape with the least time summed over the scenarios."""
    totals = {}
    for row in rows:
        if "us" in row and row["kernel"].startswith("{"):
            totals[row["kernel"]] = totals.get(row["kernel"], 0) + row["us"]
    return json.loads(min(totals, key=totals.get))


def triton_pow2(m: int) -> int:
    p = 1
    while p < m:
        p *= 2
    return p


PROMPT = "Alice: How are you today? Bob: I am fine, thank you. And you? Alice: What is two plus two?"


def step_speed(backend, batches=(1, 8, 64, 128), prompt_tokens: int = 16) -> list[dict]:
    ids = (backend.encode(PROMPT) * 100)[:prompt_tokens]
    out = []
    for batch in batches:
        for fused, compiled in ((False, False), (False, True), (True, False)):
            decoder = BatchedDecoder(backend.decoder_weights, batch, compile=compiled, fused=fused, prefill_chunk=4096)
            for i in range(batch):
                decoder.add(Sequence(i, list(ids), Sampling(), 400))
            while any(s.next_token is None for s in decoder.rows):
                decoder.step()
            for _ in range(5):
                decoder.step()
            steps = 100
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(steps):
                decoder.step()
            decoder._drain()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            row = {
                "batch": batch,
                "prompt_tokens": prompt_tokens,
                "fused": fused,
                "compiled": compiled,
                "step_ms": seconds / steps * 1000,
                "tok_s": batch * steps / seconds,
            }
            say(row)
            out.append(row)
            del decoder
            torch.cuda.empty_cache()
    return out


def profile(backend, batch: int, fused: bool) -> dict:
    decoder = BatchedDecoder(backend.decoder_weights, batch, cuda_graphs=True, fused=fused, compile=False)
    decoder.use_graphs = False  # eager, to see each kernel (the fused step's are the graph's)
    ids = backend.encode(PROMPT)[:16]
    for i in range(batch):
        decoder.add(Sequence(i, ids, Sampling(), 64))
    for _ in range(4):
        decoder.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decoder.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = {}
    for e in kernels:
        top[e.name[:50]] = top.get(e.name[:50], 0) + e.device_time
    return {
        "batch": batch,
        "fused": fused,
        "kernels": len(kernels),
        "gpu_ms": sum(e.device_time for e in kernels) / 1000,
        "top": sorted(((round(v / 1000, 3), k) for k, v in top.items()), reverse=True)[:8],
    }


def hold_row(decoder, columns: int, row: int = 0) -> None:
    """Give `row` its own pages for `columns` columns, as admission does, so that prefill passes
    called directly write and read them (a row that holds none points at the scratch page)."""
    decoder.kv.release([row])
    decoder.pages.take(row, columns)


def prefill_profile(backend, tokens: int = 1044) -> dict:
    ids = (backend.encode(PROMPT) * 100)[:tokens]
    result = {}
    for chunk in (512, 2048):
        decoder = BatchedDecoder(backend.decoder_weights, 1, prefill_chunk=chunk)
        times = []
        for round_ in range(4):
            decoder.clear()
            decoder.add(Sequence(round_, list(ids), Sampling(), 4))
            torch.cuda.synchronize()
            started = time.perf_counter()
            while not decoder.step():
                pass
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        result[f"chunk_{chunk}_first_token_ms"] = [round(t * 1000, 2) for t in times]
    pieces = []  # the prompt in 512-token pieces, as when streams are decoding
    with torch.inference_mode():
        hold_row(decoder, tokens)
        for _ in range(3):
            row = []
            for at in range(0, tokens, 512):
                torch.cuda.synchronize()
                started = time.perf_counter()
                decoder.prefill.run([(0, ids[at : at + 512], at)], lora_rows=[-1])
                torch.cuda.synchronize()
                row.append(round((time.perf_counter() - started) * 1000, 2))
            pieces.append(row)
    result["pieces_512_ms"] = pieces
    with torch.inference_mode():  # the table is an inference tensor
        decoder.kv.release([0])
    decoder.clear()
    decoder.add(Sequence(9, list(ids), Sampling(), 4))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        while not decoder.step():
            pass
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = {}
    for e in kernels:
        top[e.name[:50]] = top.get(e.name[:50], 0) + e.device_time
    result["profile_chunk_2048"] = {
        "kernels": len(kernels),
        "gpu_ms": sum(e.device_time for e in kernels) / 1000,
        "top": sorted(((round(v / 1000, 3), k) for k, v in top.items()), reverse=True)[:12],
    }
    return result


def continued(backend) -> list[dict]:
    """One piece prefilled after cached columns, by attention: bottom-right causal (flash) against
    an explicit mask (memory-efficient kernel), in-process, median of 5."""
    import backends.torch.network as torch_model

    ids = (backend.encode(PROMPT) * 100)[:1100]
    decoder = BatchedDecoder(backend.decoder_weights, 1)
    default = torch_model.LOWER_RIGHT_FROM
    rows = []
    for cached, new in ((2, 1050), (1000, 15), (1000, 64), (512, 512), (1000, 100)):
        for name, threshold in (("bottom-right causal", 0), ("explicit mask", 10**9)):
            torch_model.LOWER_RIGHT_FROM = threshold
            times = []
            with torch.inference_mode():
                hold_row(decoder, cached + new)
                for _ in range(6):
                    decoder.prefill.run([(0, ids[:cached], 0)], lora_rows=[-1])
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    decoder.prefill.run([(0, ids[cached : cached + new], cached)], lora_rows=[-1])
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - started)
            rows.append({"cached": cached, "new": new, "attention": name, "ms": sorted(times[1:])[2] * 1000})
            say(rows[-1])
    torch_model.LOWER_RIGHT_FROM = default
    return rows


def parity(dtype: str) -> dict:
    """Greedy ids fused against unfused (8 prompts, 48 tokens), batched against alone, fused."""
    backend = load_backend("torch", LoadOptions(model="random:phi-2", device="cuda", dtype=dtype, warmup=False))
    prompts = [PROMPT[: 10 + 9 * i] for i in range(8)]

    def decode(decoder, chosen):
        decoder.clear()
        ids = (
            __import__("backends.decoding.drive", fromlist=["drive"])
            .drive(decoder, [Sequence(i, backend.encode(prompts[i]), Sampling(), 48) for i in chosen])
            .ids
        )
        return [ids[i] for i in chosen]

    fused8 = BatchedDecoder(backend.decoder_weights, 8, fused=True)
    plain8 = BatchedDecoder(backend.decoder_weights, 8, fused=False)
    fused1 = BatchedDecoder(backend.decoder_weights, 1, fused=True)
    together = decode(fused8, range(8))
    alone = [decode(fused1, [i])[0] for i in range(8)]
    unfused = decode(plain8, range(8))
    # One step's logits, fused against unfused, same inputs.
    ids = backend.encode(PROMPT)
    logits = {}
    for name, decoder in (("fused", fused1), ("unfused", BatchedDecoder(backend.decoder_weights, 1, fused=False))):
        decoder.clear()
        decoder.add(Sequence(0, ids, Sampling(), 8))
        decoder.step()
        with torch.inference_mode():
            launched = decoder._launch([0])
        logits[name] = launched.logits[0].float().clone()
    diff = float((logits["fused"] - logits["unfused"]).abs().max())
    # Sampled rows (drawn on the device from each request's seed): batched equal to alone.
    samplings = [Sampling(temperature=0.9, seed=i, top_k=[0, 40][i % 2], top_p=[1.0, 0.9][i // 4]) for i in range(8)]

    def sample(decoder, chosen):
        decoder.clear()
        ids = (
            __import__("backends.decoding.drive", fromlist=["drive"])
            .drive(decoder, [Sequence(i, backend.encode(prompts[i]), samplings[i], 48) for i in chosen])
            .ids
        )
        return [ids[i] for i in chosen]

    sampled_together = sample(fused8, range(8))
    sampled_alone = [sample(fused1, [i])[0] for i in range(8)]
    greedy_like = sum(a == b for a, b in zip(sampled_together, together, strict=False))
    result = {
        "sampled_batched_vs_alone_identical": sum(
            a == b for a, b in zip(sampled_together, sampled_alone, strict=False)
        ),
        "sampled_equal_to_greedy": greedy_like,
        "batched_vs_alone_identical": sum(a == b for a, b in zip(together, alone, strict=False)),
        "fused_vs_unfused_identical": sum(a == b for a, b in zip(together, unfused, strict=False)),
        "step_logits_max_abs_diff": diff,
        "logit_scale": float(logits["unfused"].abs().max()),
    }
    backend = None  # freed before empty_cache; rebound, not deleted: decode() and sample() name it
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["bandwidth"] = bandwidths()
    say(RESULTS)

    def wanted(name):
        return not only or name in only

    import traceback

    def section(name, fn):
        try:
            return fn()
        except Exception:  # one section failing does not lose the others' numbers
            RESULTS[f"{name}_error"] = traceback.format_exc()[-3000:]
            say(RESULTS[f"{name}_error"])

    if wanted("parity"):
        for dtype in ("float32", "bfloat16"):
            RESULTS[f"parity_{dtype}"] = section(f"parity_{dtype}", lambda: parity(dtype))
            say(dtype, RESULTS[f"parity_{dtype}"])
    if wanted("step") or wanted("profile") or wanted("prefill") or wanted("attention") or wanted("continued"):
        backend = load_backend(
            "torch", LoadOptions(model="random:phi-2", device="cuda", dtype="bfloat16", warmup=False)
        )
        weight_bytes = sum(p.numel() * p.element_size() for p in backend.model.parameters())
        RESULTS["limit_tok_s"] = RESULTS["bandwidth"]["copy_bytes_s"] / weight_bytes
        if wanted("attention"):
            RESULTS["attention"] = section("attention", attention_sweep) or []
            for row in RESULTS["attention"]:
                say(row)
            if RESULTS["attention"]:
                RESULTS["attention_best"] = best_attention(RESULTS["attention"])
                say(
                    "least total time:",
                    RESULTS["attention_best"],
                    "(the steps use the defaults:",
                    triton_attention.ATTENTION,
                    ")",
                )
        if wanted("profile"):
            RESULTS["profiles"] = [section("profile", lambda: profile(backend, b, True)) for b in (1, 64)]
            for p in RESULTS["profiles"]:
                say(p)
        if wanted("step"):
            RESULTS["steps"] = section("steps", lambda: step_speed(backend)) or []
            RESULTS["steps_long"] = (
                section("steps_long", lambda: step_speed(backend, batches=(1, 32), prompt_tokens=1044)) or []
            )
        if wanted("continued"):
            RESULTS["continued"] = section("continued", lambda: continued(backend))
        if wanted("prefill"):
            RESULTS["prefill"] = section("prefill", lambda: prefill_profile(backend))
            say(RESULTS["prefill"])
    (out / "kernels.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    say("limit tok/s", RESULTS.get("limit_tok_s"), "bandwidth", RESULTS["bandwidth"])
    for row in RESULTS.get("steps", []) + RESULTS.get("steps_long", []):
        say(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
