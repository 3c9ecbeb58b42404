"""GPU check for the CUDA fast path: run on a CUDA machine from the repository root.

    python3 tests/gpu/check.py --out results/        # about 6 minutes on one H200

1. Builds Phi-2's architecture with random weights on the GPU (`random:phi-2`).
2. Correctness: the fast path against transformers' forward (float32 logits), and greedy ids
   of sequences decoded in one batch against each decoded alone (float32, then bfloat16).
3. In-process decode speed: transformers `generate` (dynamic and static cache) against the
   fast path at batch 1, 8, 32, 64, and the memory-bandwidth limit measured in the same run.
4. A real server (`phi2_server.py`, MAX_BATCH=64): time to ready, then bench.py at
   concurrency 1, 8, 32, 64. Prints a table; writes every number to --out.
5. quant: int8/int4 weight-only kernels on Phi-2's shapes (bench.py --quant-kernels), logits
   against bfloat16 (--quant-quality), greedy ids; serve_quant: a server per PHI2_QUANTIZE at 1
   and 64 clients. prompt_cache: a 1,000-token shared prefix, cache on against off
   (bench.py --shared-prefix 1 and 8).
adapters: per-request LoRA adapters, float32: a batch mixing the base model and 3 adapters
   (CUDA graphs) against each sequence alone, and the fast path's logits with an adapter against
   transformers' forward with it merged; then bench.py --adapters (bfloat16).
constrained: structured output, float32: greedy rows under a JSON Schema beside plain ones, with
   CUDA graphs (their steps chain, the masks applied after each forward pass) against the same
   without graphs; then bench.py --constrained's measurement at 1 and 64 (bfloat16), each
   decoder's KV pool sized (CONSTRAINED_KV_BYTES).
scale: issue 18's workloads over HTTP (MAX_BATCH=128, or $SCALE_MAX_BATCH): 1, 64 and 256 clients,
   a 1,044-token prompt's TTFT, 63 streams' inter-token latency while such prompts arrive.
`--only quant,prompt_cache` runs just those sections. A section that raises, or whose bench.py
or server fails, is reported at the end, and check.py exits 1. Not part of `make test` (CI has no
GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

PROMPT = "Alice: How are you today? Bob: I am fine, thank you. And you? Alice: What is two plus two?"
RESULTS: dict = {}
SKIP: set[str] = set()
FAILED: list[str] = []  # what failed, by section: check.py's exit status is 1 if any
SECTION = ["setup"]  # the section running (`section`), for failures found inside it
# The constrained speed step's KV budget for each decoder: benchmarks/constrained.py holds a
# decoder of each batch size in turn and the runtime lays each pool out whole, so at the default
# budget (most of the free memory) the second pool, beside the warm-up's, ran out of memory.
CONSTRAINED_KV_BYTES = 8 * 2**30


def say(*parts) -> None:
    print(*parts, flush=True)


def failed(what: str) -> None:
    """Record a failure of the running section (check.py exits 1 at the end)."""
    FAILED.append(f"{SECTION[0]}: {what}")
    say("FAILED", FAILED[-1])


def section(name: str, run) -> None:
    """Run a section; if it raises, record the failure (with its traceback) and go on."""
    SECTION[0] = name
    try:
        run()
    except Exception as exc:  # reported at the end: the other sections still run
        traceback.print_exc()
        RESULTS[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        failed(f"{type(exc).__name__}: {exc}"[:300])
    finally:
        torch.cuda.empty_cache()


def timed_cuda(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = min(timed_cuda(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * src.numel() * src.element_size() / seconds


def decode_alone(backend, prompts, n, decoder) -> list[list[int]]:
    out = []
    for prompt in prompts:
        decoder.clear()
        out.append(drive(decoder, [Sequence(1, backend.encode(prompt), Sampling(), n)]).ids[1])
    return out


def decode_together(backend, prompts, n, decoder) -> list[list[int]]:
    decoder.clear()
    sequences = [Sequence(i, backend.encode(prompt), Sampling(), n) for i, prompt in enumerate(prompts)]
    ids = drive(decoder, sequences).ids
    return [ids[i] for i in range(len(prompts))]


def parity(dtype: str) -> dict:
    backend = load_backend("torch", LoadOptions(model="random:phi-2", device="cuda", dtype=dtype, warmup=False))
    prompts = [PROMPT[: 10 + 9 * i] for i in range(8)]
    n = 48
    result = {}
    if dtype == "float32":
        ids = torch.tensor([backend.encode(PROMPT)], device="cuda")
        with torch.inference_mode():
            reference = backend.model(ids).logits[0, -1].float()
        decoder = BatchedDecoder(backend.decoder_weights, 1, cuda_graphs=False)
        fast = decoder.logits_after(ids[0].tolist())
        decodable = backend.decoder_weights.decodable  # the fast path masks the ids the tokenizer cannot decode
        result["max_abs_logit_diff_vs_transformers"] = float((fast[:decodable] - reference[:decodable]).abs().max())
        # The CUDA-graph decoder's prefill: one unpadded piece, the Triton rotary/cache kernel, flash attention.
        fast = BatchedDecoder(backend.decoder_weights, 1).logits_after(ids[0].tolist())
        result["max_abs_logit_diff_vs_transformers_fused_prefill"] = float(
            (fast[:decodable] - reference[:decodable]).abs().max()
        )
        result["logit_scale"] = float(reference.abs().max())
    single = BatchedDecoder(backend.decoder_weights, 1)
    alone = decode_alone(backend, prompts, n, single)
    batched = decode_together(backend, prompts, n, BatchedDecoder(backend.decoder_weights, 8))
    same = sum(a == b for a, b in zip(alone, batched, strict=False))
    first = [
        next((t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        for a, b in zip(alone, batched, strict=False)
    ]
    result.update(sequences=len(prompts), tokens=n, identical=same, first_divergence=first)
    if dtype == "bfloat16" and "compile" not in SKIP:
        compiled = decode_alone(backend, prompts, n, BatchedDecoder(backend.decoder_weights, 1, compile=True))
        result["compiled_identical_to_eager"] = sum(a == b for a, b in zip(alone, compiled, strict=False))
    del backend, single
    torch.cuda.empty_cache()
    return result


def adapter_parity() -> dict:
    """Per-request adapters on the GPU, float32: mixed batches equal each sequence alone, and the
    unmerged product equals the adapter merged into transformers' weights."""
    import tempfile

    from benchmarks.adapters import write_random_adapters

    folder = tempfile.mkdtemp(prefix="adapters-")
    backend = load_backend(
        "torch", LoadOptions(model="random:phi-2", device="cuda", dtype="float32", adapters_dir=folder, warmup=False)
    )
    adapters = [backend.adapters.get(name) for name in write_random_adapters(backend, folder, 3)]
    prompts = [PROMPT[: 10 + 9 * i] for i in range(8)]
    chosen = [None if i % 4 == 0 else adapters[i % 4 - 1] for i in range(8)]
    n = 32

    def sequences(decoder, pairs):
        decoder.clear()
        ids = drive(
            decoder, [Sequence(i, backend.encode(p), Sampling(), n, adapter=a) for i, (p, a) in enumerate(pairs)]
        ).ids
        return [ids[i] for i in range(len(pairs))]

    single = BatchedDecoder(backend.decoder_weights, 1)
    alone = [sequences(single, [pair])[0] for pair in zip(prompts, chosen, strict=False)]
    together = sequences(BatchedDecoder(backend.decoder_weights, 8), list(zip(prompts, chosen, strict=False)))
    base = sequences(BatchedDecoder(backend.decoder_weights, 8), [(p, None) for p in prompts])
    result = {
        "sequences": 8,
        "tokens": n,
        "identical_batched_vs_alone": sum(a == b for a, b in zip(alone, together, strict=False)),
        "adapter_changes_ids": sum(a != b for a, b, c in zip(together, base, chosen, strict=False) if c is not None),
    }
    ids = backend.encode(PROMPT)
    fast = BatchedDecoder(backend.decoder_weights, 1, cuda_graphs=False).logits_after(ids, adapters[0])
    with torch.no_grad():
        for name, (a, b) in adapters[0].modules.items():
            weight = backend.model.get_submodule(name).weight
            weight += (adapters[0].scale * (a.double() @ b.double()).T).to(device=weight.device, dtype=weight.dtype)
        reference = backend.model(torch.tensor([ids], device="cuda")).logits[0, -1].float()
    decodable = backend.decoder_weights.decodable
    result["max_abs_logit_diff_vs_merged_transformers"] = float((fast[:decodable] - reference[:decodable]).abs().max())
    result["logit_scale"] = float(reference.abs().max())
    return result  # its model is freed on return (main empties the cache)


def constrained_parity() -> dict:
    """Constrained greedy rows chain on the GPU: their masks are applied after the forward pass
    that the previous step's tokens fed on the device. The ids must equal an unchained decode's."""
    from benchmarks.constrained import TYPICAL_SCHEMA, constrained_outputs_check

    backend = load_backend("torch", LoadOptions(model="random:phi-2", device="cuda", dtype="float32", warmup=False))
    constraint = backend.constraint("json_schema", json.dumps(TYPICAL_SCHEMA))
    prompts = [PROMPT[: 10 + 9 * i] for i in range(8)]

    def decode(decoder):
        sequences = [
            Sequence(i, backend.encode(p), Sampling(constraint=constraint.matcher() if i % 2 == 0 else None), 64)
            for i, p in enumerate(prompts)
        ]
        ids = drive(decoder, sequences).ids
        return [ids[i] for i in range(len(prompts))]

    chained = decode(BatchedDecoder(backend.decoder_weights, 8))
    unchained = decode(BatchedDecoder(backend.decoder_weights, 8, cuda_graphs=False))
    result = {
        "sequences": 8,
        "constrained": 4,
        "tokens": 64,
        "identical_chained_vs_unchained": sum(a == b for a, b in zip(chained, unchained, strict=False)),
    }
    result["sampled_outputs"] = constrained_outputs_check(
        backend, backend.encode("Alice: Describe yourself as a JSON record.\nBob:")
    )
    return result  # its model is freed on return (main empties the cache)


def speed() -> dict:
    backend = load_backend("torch", LoadOptions(model="random:phi-2", device="cuda", dtype="bfloat16", warmup=False))
    model = backend.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth()
    result = {
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_s": bandwidth,
        "limit_tok_s": bandwidth / weight_bytes,
    }
    ids = torch.tensor([backend.encode(PROMPT)[:16]], device="cuda")
    n = 128
    for name, kwargs in [("generate_dynamic", {}), ("generate_static", {"cache_implementation": "static"})]:
        if name in SKIP:
            continue
        try:
            started = time.perf_counter()
            model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs
            )  # warm-up / compile
            warm = time.perf_counter() - started
            seconds = timed_cuda(
                lambda: model.generate(
                    ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs
                )
            )
            result[name] = {"tok_s": n / seconds, "first_call_s": warm}
        except Exception as exc:  # reported, not fatal: the fast path is what this checks
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        say(name, result[name])
    result["profile_batch_1"] = profile_step(backend)
    say("profile batch 1", result["profile_batch_1"])
    # The default CUDA step (Triton between cuBLAS GEMMs), then the step it replaced: eager, and
    # compiled (the default before), in the same run.
    variants = [(b, False, None) for b in (1, 8, 32, 64, 128)] + [(1, False, False), (64, False, False)]
    variants += [(1, True, False), (64, True, False)] if "compile" not in SKIP else []
    for batch, compiled, fused in variants:
        decoder = BatchedDecoder(backend.decoder_weights, batch, compile=compiled, fused=fused)
        started = time.perf_counter()
        decoder.capture(spans=(128, 256))
        capture = time.perf_counter() - started
        decoder.clear()
        for i in range(batch):
            decoder.add(Sequence(i, ids[0].tolist(), Sampling(), n))
        decoder.step()  # prefill (all 16-token prompts fit one chunk budget at these sizes)
        while any(s.next_token is None for s in decoder.rows):
            decoder.step()
        steps = 100
        seconds = timed_cuda(lambda: [decoder.step() for _ in range(steps)])
        name = f"fast_batch_{batch}" + ("" if fused is None else "_compiled_unfused" if compiled else "_eager_unfused")
        result[name] = {"step_ms": seconds / steps * 1000, "tok_s": batch * steps / seconds, "capture_s": capture}
        say(name, result[name])
        decoder = None  # freed before empty_cache; rebound, not deleted: the lambdas above name it
        torch.cuda.empty_cache()
    backend = model = None  # freed before empty_cache; rebound, not deleted: the lambdas above name them
    torch.cuda.empty_cache()
    return result


def profile_step(backend) -> dict:
    """Where a batch-1 decode step's GPU time goes (eager kernels; a graph replays the same ones)."""
    decoder = BatchedDecoder(backend.decoder_weights, 1)
    decoder.use_graphs = False  # launched one by one, to see each kernel
    decoder.add(Sequence(0, backend.encode(PROMPT)[:16], Sampling(), 64))
    for _ in range(4):
        decoder.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decoder.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    gemm = sum(
        e.device_time for e in kernels if any(t in e.name.lower() for t in ("gemm", "gemv", "cutlass", "nvjet", "sm90"))
    )
    top = {}
    for e in kernels:
        top[e.name[:60]] = top.get(e.name[:60], 0) + e.device_time
    return {
        "kernels": len(kernels),
        "gpu_ms": total / 1000,
        "gemm_ms": gemm / 1000,
        "top": sorted(((round(v / 1000, 3), k) for k, v in top.items()), reverse=True)[:12],
    }


def quant_parity(method: str) -> dict:
    """Greedy ids of quantized weights against bfloat16 on the fast path (CUDA graphs), 8 prompts."""
    backend = load_backend("torch", LoadOptions(model="random:phi-2", device="cuda", dtype="bfloat16", warmup=False))
    prompts = [PROMPT[: 10 + 9 * i] for i in range(8)]
    n = 32
    reference = decode_together(backend, prompts, n, BatchedDecoder(backend.decoder_weights, 8))
    started = time.perf_counter()
    quantized = backend.quantize(method)
    seconds = time.perf_counter() - started
    batched = decode_together(backend, prompts, n, BatchedDecoder(backend.decoder_weights, 8))
    alone = decode_alone(backend, prompts, n, BatchedDecoder(backend.decoder_weights, 1))
    result = {
        "quantize_s": seconds,
        "weight_bytes": sum(q.nbytes for q in quantized),
        "tokens_same_as_bf16": sum(
            a == b for x, y in zip(reference, batched, strict=False) for a, b in zip(x, y, strict=False)
        ),
        "tokens": len(prompts) * n,
        "batched_identical_to_alone": sum(a == b for a, b in zip(alone, batched, strict=False)),
    }
    del backend, quantized
    torch.cuda.empty_cache()
    return result


def run_bench(*arguments: str, env: dict | None = None, timeout: int = 500, script: Path = ROOT / "bench.py") -> str:
    """bench.py's output (or `script`'s); a non-zero exit is a failure of the section."""
    command = [sys.executable, str(script), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    say(done.stdout)
    say(done.stderr[-2000:])
    if done.returncode != 0:
        failed(f"{script.name} {' '.join(arguments)} exited {done.returncode}")
    return done.stdout


def constrained_speed() -> int:
    """bench.py --constrained's measurement (benchmarks/constrained.py) at 1 and 64 rows, in this
    process (check.py --constrained-speed), with the backend bench.py would load but for its KV
    budget: CONSTRAINED_KV_BYTES, so that a decoder made beside another fits."""
    import benchmarks.constrained as constrained
    from backends.choose import select_backend
    from benchmarks.in_process import server_load_options

    name, options = server_load_options({"PHI2_MODEL": "random:phi-2", **os.environ})  # as the benchmark sets it
    options = dataclasses.replace(options, kv_cache_bytes=CONSTRAINED_KV_BYTES)
    backend = load_backend(select_backend(name), options)
    constrained.load_in_process = lambda: backend  # the benchmark's own loader, sized
    say("| batch | temperature | unconstrained tok/s | with the schema tok/s | with / without |")
    say("| --- | --- | --- | --- | --- |")
    constrained.constrained_decoding(argparse.Namespace(concurrency="1,64", max_tokens=128, runs=4))
    return 0


def serve_and_bench(
    out: Path,
    compile: bool,
    quantize: str = "",
    concurrency: str = "1,8,32,64",
    max_batch: int = 64,
    latency: bool = False,
) -> dict:
    out = out / f"serve-compile{int(compile)}{'-' + quantize if quantize else ''}-batch{max_batch}"
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PHI2_COMPILE": str(int(compile)),
        "PHI2_MODEL": "random:phi-2",
        "MAX_BATCH": str(max_batch),
        "MAX_QUEUE": "1024",
        "LOG_DIR": str(out.parent / f"logs-{out.name}"),
        "ADAPTER_PATH": "",
        "PHI2_QUANTIZE": quantize,
    }
    port = 8321
    started = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "phi2_server.py"), "--port", str(port)],
        env=env,
        stdout=open(out / "server.log", "w"),
        stderr=subprocess.STDOUT,
    )
    import urllib.request

    ready = None
    while time.perf_counter() - started < 240:
        if server.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                if response.status == 200:
                    ready = time.perf_counter() - started
                    break
        except OSError:
            pass
        time.sleep(0.5)
    result = {"startup_to_ready_s": ready}
    say("server ready after", ready)
    if ready is None:
        failed(f"the server ({out.name}) was not ready (see {out / 'server.log'})")
    if ready is not None:
        label = f"H200 compile={int(compile)}" + (f" {quantize}" if quantize else "")

        def worker_stats() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/model/info", timeout=5) as response:
                return json.loads(response.read())["stats"]

        result["bench_table"], result["worker"] = "", {}
        for level in concurrency.split(","):  # one level at a time: the worker's stats per level
            before = worker_stats()
            command = [
                sys.executable,
                str(ROOT / "bench.py"),
                "--url",
                f"http://127.0.0.1:{port}",
                "--concurrency",
                level,
                "--max-tokens",
                "128",
                "--runs",
                "3",
                "--prompt",
                PROMPT,
                "--label",
                label,
                "--json",
                str(out / f"bench-{level}.json"),
            ]
            bench = subprocess.run(command, capture_output=True, text=True, timeout=600)
            say(bench.stdout)
            say(bench.stderr[-3000:])
            if bench.returncode != 0:
                failed(f"bench.py at concurrency {level} ({out.name}) exited {bench.returncode}")
            result["bench_table"] += bench.stdout
            after = worker_stats()
            steps = max(after["decode_steps"] - before["decode_steps"], 1)
            result["worker"][level] = {
                "decode_steps": steps,
                "tokens_per_step": (after["tokens_generated"] - before["tokens_generated"]) / steps,
                "decode_ms_per_step": 1000 * (after["decode_seconds"] - before["decode_seconds"]) / steps,
                "busy_ms_per_step": 1000 * (after["busy_seconds"] - before["busy_seconds"]) / steps,
            }
            say("worker", level, result["worker"][level])
        if latency:  # a 1,044-token prompt's TTFT, then 63 streams' inter-token latency as such prompts arrive
            command = [
                sys.executable,
                str(ROOT / "bench.py"),
                "--url",
                f"http://127.0.0.1:{port}",
                "--latency",
                "--streams",
                "63",
                "--max-tokens",
                "512",
                "--long-prompt-tokens",
                "1044",
                "--rounds",
                "5",
                "--prompt",
                PROMPT,
                "--json",
                str(out / "latency.json"),
            ]
            bench = subprocess.run(command, capture_output=True, text=True, timeout=300)
            say(bench.stdout)
            say(bench.stderr[-3000:])
            if bench.returncode != 0:
                failed(f"bench.py --latency ({out.name}) exited {bench.returncode}")
            result["latency_table"] = bench.stdout
    server.terminate()
    server.wait(60)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument(
        "--skip",
        default="",
        help="comma list to skip: parity,speed,serve0,serve1,compile,generate_dynamic,generate_static",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma list of sections to run instead: "
        "parity,speed,serve0,serve1,scale,quant,serve_quant,prompt_cache,adapters,constrained",
    )
    parser.add_argument("--constrained-speed", action="store_true", help=argparse.SUPPRESS)  # `constrained`'s step
    args = parser.parse_args()
    if args.constrained_speed:
        return constrained_speed()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    if only:  # every section not named is skipped
        skip |= {
            "parity",
            "speed",
            "serve0",
            "serve1",
            "scale",
            "quant",
            "serve_quant",
            "prompt_cache",
            "adapters",
            "constrained",
        } - only
    SKIP.update(skip)
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    say(RESULTS)
    torch.backends.cuda.matmul.allow_tf32 = False

    def parities() -> None:
        RESULTS["parity_float32"] = parity("float32")
        say("parity float32", RESULTS["parity_float32"])
        RESULTS["parity_bfloat16"] = parity("bfloat16")
        say("parity bfloat16", RESULTS["parity_bfloat16"])

    def scale() -> None:
        # Issue 18's workloads through HTTP: 1, 64 and 256 clients against MAX_BATCH=128, then the
        # long-prompt TTFT and the inter-token latency of 63 streams while long prompts arrive.
        RESULTS["serve_scale"] = serve_and_bench(
            out, True, concurrency="1,64,256", max_batch=int(os.environ.get("SCALE_MAX_BATCH", "128")), latency=True
        )

    def quant() -> None:
        # Weight-only int8/int4 (PHI2_QUANTIZE): kernels, logits against bfloat16, greedy ids;
        # then (serve_quant) a served model at 1 and 64 clients beside bfloat16 in the same run.
        RESULTS["quant_kernels"] = run_bench("--quant-kernels")
        RESULTS["quant_quality"] = run_bench("--quant-quality", env={"PHI2_MODEL": "random:phi-2"})
        for method in ("int8", "int4"):
            RESULTS[f"quant_parity_{method}"] = quant_parity(method)
            say(method, RESULTS[f"quant_parity_{method}"])

    def serve_quant() -> None:
        for method in ("", "int8", "int4"):
            RESULTS[f"serve_quant_{method or 'bf16'}"] = serve_and_bench(out, True, method, concurrency="1,64")

    def prompt_cache() -> None:
        # A 1,000-token shared prefix plus a short question: TTFT with the prompt cache against
        # without, one client, then 8 at once.
        for clients in ("1", "8"):
            RESULTS[f"prompt_cache_shared_{clients}"] = run_bench(
                "--shared-prefix",
                clients,
                "--prefix-tokens",
                "1000",
                "--max-tokens",
                "16",
                "--rounds",
                "5",
                env={"PHI2_MODEL": "random:phi-2", "MAX_BATCH": "16"},
                timeout=560,  # two servers on one GPU: 16 slots each
            )

    def adapters() -> None:
        RESULTS["adapter_parity"] = adapter_parity()
        torch.cuda.empty_cache()
        say("adapter parity", RESULTS["adapter_parity"])
        RESULTS["adapter_speed"] = run_bench(
            "--adapters", "--max-tokens", "128", "--runs", "4", env={"PHI2_MODEL": "random:phi-2"}
        )

    def constrained() -> None:
        RESULTS["constrained_parity"] = constrained_parity()
        torch.cuda.empty_cache()
        say("constrained parity", RESULTS["constrained_parity"])
        # In a process of its own, as bench.py's would be, with each decoder's KV pool sized.
        RESULTS["constrained_speed"] = run_bench("--constrained-speed", script=Path(__file__), timeout=560)

    sections = [("parity", parities), ("speed", lambda: RESULTS.update(speed=speed()))]
    for compile in (False, True):
        sections.append(
            (
                f"serve{int(compile)}",
                lambda c=compile: RESULTS.update({f"serve_compile{int(c)}": serve_and_bench(out, c)}),
            )
        )
    sections += [
        ("scale", scale),
        ("quant", quant),
        ("serve_quant", serve_quant),
        ("prompt_cache", prompt_cache),
        ("adapters", adapters),
        ("constrained", constrained),
    ]
    for name, run in sections:
        if name not in skip:
            section(name, run)
    RESULTS["failed"] = FAILED
    (out / "results.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    say(json.dumps({k: v for k, v in RESULTS.items() if not k.startswith("serve")}, indent=1, default=str))
    if FAILED:
        say(f"{len(FAILED)} failed:\n  " + "\n  ".join(FAILED))
        return 1
    say("every section ran without a failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
