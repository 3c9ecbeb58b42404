#!/usr/bin/env python
"""Benchmark grammar libraries (xgrammar, llguidance, outlines-core) for JSON-schema constrained
decoding on a Phi-2 (CodeGen/GPT-2 byte-level BPE) tokenizer with the model's vocab of 51,200.

Run (libraries installed with pip --target, never into the project venv):
    PYTHONPATH=/tmp/grammar/libs .venv/bin/python docs/grammar-libraries/measure.py \
        [--libs xgr,llg,oc] [--steps 200] [--batch 64] [--batch-steps 100] [--patho-timeout 30] \
        [--no-patho] [--out results.json]

The driver runs every library (and every pathological case) in a fresh subprocess
(`--worker LIB` / `--patho LIB CASE`), collects JSON lines and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.environ.get("PHI2_TOKENIZER", os.path.join(HERE, "phi2-tokenizer"))
VOCAB = 51200  # Phi-2 lm_head size; tokenizer has 50,295 ids, the rest must never be allowed
EOS = 50256

# ---------------------------------------------------------------- schemas + sample documents
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["name", "age", "email"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["active", "inactive", "banned"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
            },
            "orders": {
                "type": "array",
                "minItems": 0,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "kind": {"enum": ["book", "toy", "food"]},
                    },
                    "required": ["sku", "qty", "kind"],
                },
            },
        },
        "required": ["id", "status", "tags", "address", "orders"],
    },
    "regex": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}-[a-z]{2,8}$"},
    "jsonmode": {"type": "object"},  # "any JSON object" (OpenAI json_object mode)
}
# (valid document, invalid document) -- serialised with json.dumps defaults: ", " and ": "
SAMPLES = {
    "flat": (
        {"name": "Al", "age": 42, "email": "al@example.com"},
        {"name": "Al", "age": 200, "email": "al@example.com"},
    ),
    "nested": (
        {
            "id": 7,
            "status": "active",
            "tags": ["a", "b"],
            "address": {"street": "1 Main St", "city": "Oslo", "zip": "01234"},
            "orders": [{"sku": "X1", "qty": 2, "kind": "toy"}],
        },
        {
            "id": 7,
            "status": "gone",
            "tags": ["a"],
            "address": {"street": "1 Main St", "city": "Oslo", "zip": "01234"},
            "orders": [],
        },
    ),
    "regex": ("ABC-1234-abcd", "AB-1234-abcd"),
    "jsonmode": ({"a": [1, {"b": None}], "c": "x", "d": {"e": {"f": [True]}}}, [1, 2]),
}
INVALID = {
    "bad_ref": '{"type":"object","properties":{"a":{"$ref":"#/nope"}}}',
    "bad_type": '{"type": 5}',
    "not_json": "{not json",
    "bad_regex": '{"type":"string","pattern":"(unclosed"}',
    "min_gt_max": '{"type":"integer","minimum":10,"maximum":1}',
    "unknown_format": '{"type":"string","format":"foo"}',
}


def patho_schema(case: str):
    if case == "deep_nest_100":
        s = {"type": "integer"}
        for _ in range(100):
            s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
        return s
    if case == "deep_nest_30":
        s = {"type": "integer"}
        for _ in range(30):
            s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
        return s
    if case == "regex_nested_counts":
        return {"type": "string", "pattern": "^((a|b){1,30}c){1,30}$"}
    if case == "enum_200k":
        return {"enum": [f"v{i:06d}" for i in range(200000)]}
    if case == "recursive_ref":
        return {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/n",
        }
    if case == "enum_20k":
        return {"enum": [f"value_{i:05d}_{(i * 7919) % 100003:x}" for i in range(20000)]}
    if case == "regex_a_aa_b1000":
        return {"type": "string", "pattern": "^(a|aa)*b{1000}$"}
    if case == "regex_dfa_blowup":  # (a|b)*a(a|b){20}: 2^20 DFA states
        return {"type": "string", "pattern": "^(a|b)*a(a|b){20}$"}
    if case == "array_min1000":
        return {"type": "array", "items": {"type": "integer"}, "minItems": 1000, "maxItems": 2000}
    if case == "str_len_100k":
        return {"type": "string", "minLength": 1, "maxLength": 100000}
    raise KeyError(case)


PATHO = [
    "deep_nest_30",
    "deep_nest_100",
    "recursive_ref",
    "enum_20k",
    "regex_a_aa_b1000",
    "regex_dfa_blowup",
    "array_min1000",
    "str_len_100k",
    "regex_nested_counts",
    "enum_200k",
]


def now():
    return time.perf_counter()


def stats(xs):
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return {}
    return {
        "mean_ms": 1e3 * sum(xs) / n,
        "p50_ms": 1e3 * xs[n // 2],
        "p99_ms": 1e3 * xs[min(n - 1, int(round(0.99 * (n - 1))))],
        "max_ms": 1e3 * xs[-1],
        "n": n,
    }


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def byte_vocab(tok):
    """token id -> raw bytes (GPT-2 byte-level decoding; added whitespace tokens are literal)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    u2b = {v: k for k, v in bytes_to_unicode().items()}
    added = {t.content for t in tok.added_tokens_decoder.values()}
    out = {}
    for s, i in tok.get_vocab().items():
        out[i] = s.encode() if s in added else bytes(u2b[c] for c in s)
    return out


# ---------------------------------------------------------------- library adapters
class Adapter:
    """Uniform interface. A 'compiled' object is whatever the library caches per schema."""

    name = "?"
    mlx_native = False

    def init(self, tok): ...
    def compile_cold(self, schema_str, key): ...  # -> compiled (no cache)
    def compile_cached(self, schema_str, key): ...  # -> compiled (from cache)
    def matcher(self, compiled): ...
    def fill(self, m, bm, row=0): ...  # bm: torch int32 (B, 1600)
    def fill_batch(self, ms, bm): ...
    def apply_torch(self, logits, bm): ...
    def apply_mlx(self, logits_mx, bm_np): ...
    def advance(self, m, t): ...  # -> bool
    def advance_batch(self, ms, toks): ...
    def accepting(self, m): ...
    def reset(self, m): ...
    def eos_advances(self):
        return True  # may EOS be fed to the matcher?


def apply_torch_generic(logits, bm):
    import torch

    bits = ((bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(bm.shape[0], -1)
    logits.masked_fill_(~bits[:, : logits.shape[1]], float("-inf"))


def apply_mlx_generic(logits, bm_np):
    import mlx.core as mx

    m = mx.array(bm_np)
    bits = ((m[..., None] >> mx.arange(32, dtype=mx.int32)) & 1).reshape(m.shape[0], -1)[:, : logits.shape[-1]]
    out = mx.where(bits.astype(mx.bool_), logits, mx.array(float("-inf"), dtype=logits.dtype))
    mx.eval(out)
    return out


class XGR(Adapter):
    name = "xgrammar"

    def init(self, tok):
        import xgrammar as xgr

        self.xgr = xgr
        self.ti = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)  # stop_token_ids = eos
        self.gc = xgr.GrammarCompiler(self.ti, max_threads=2, cache_enabled=True, cache_limit_bytes=256 << 20)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        try:
            from xgrammar.kernels.apply_token_bitmask_mlx import apply_token_bitmask_mlx

            self._mlx = apply_token_bitmask_mlx
            self.mlx_native = True
        except Exception:
            self._mlx = None

    def _compile(self, s, key):
        if key == "jsonmode":  # any JSON object; strict_mode=False so extra properties are allowed
            return self.gc.compile_json_schema(s, any_whitespace=False, strict_mode=False)
        return self.gc.compile_json_schema(s, any_whitespace=False)

    def compile_cold(self, s, key):
        self.gc.clear_cache()
        return self._compile(s, key)

    def compile_cached(self, s, key):
        return self._compile(s, key)

    def matcher(self, c):
        return self.xgr.GrammarMatcher(c)

    def fill(self, m, bm, row=0):
        m.fill_next_token_bitmask(bm, row)

    def fill_batch(self, ms, bm):
        self.batch.batch_fill_next_token_bitmask(ms, bm)

    def apply_torch(self, logits, bm):
        self.xgr.apply_token_bitmask_inplace(logits, bm)  # CPU: C++ kernel

    def apply_mlx(self, logits, bm_np):
        import mlx.core as mx

        out = self._mlx(mx.array(bm_np), logits, logits.shape[-1])
        mx.eval(out)
        return out

    def advance(self, m, t):
        return m.accept_token(t)

    def advance_batch(self, ms, toks):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, toks)

    def accepting(self, m):
        return m.is_completed() or m.is_terminated()

    def reset(self, m):
        m.reset()


class LLG(Adapter):
    name = "llguidance"
    OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def init(self, tok):
        import llguidance as llg
        import llguidance.hf
        import llguidance.numpy as lnp

        self.llg, self.lnp = llg, lnp
        self.lt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.ex = llg.LLExecutor(num_threads=2)
        self.cache = {}
        self._torch_apply = None

    def compile_cold(self, s, key):
        g = self.llg.LLMatcher.grammar_from_json_schema(s, defaults=self.OPTS)
        err = self.llg.LLMatcher.validate_grammar(g, self.lt)
        if err:
            raise ValueError(err)
        m = self.llg.LLMatcher(self.lt, g, log_level=0)
        self.cache[s] = m  # app-level cache: a pristine matcher, deep_copy()'d per sequence
        return m

    def compile_cached(self, s, key):
        return self.cache[s]

    def matcher(self, c):
        return c.deep_copy()

    def fill(self, m, bm, row=0):
        v = bm[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def fill_batch(self, ms, bm):
        self.ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bm.data_ptr(), bm.shape[1] * 4, bm.shape[0])

    def apply_torch(self, logits, bm):
        if self._torch_apply is None:
            try:
                import llguidance.torch as lt

                self._torch_apply = lt.apply_token_bitmask_inplace  # torch.compile'd kernel
                self._torch_apply(logits.clone(), bm)
            except Exception as e:  # no C compiler etc.
                print(f"llguidance torch kernel unavailable ({type(e).__name__}); generic", file=sys.stderr)
                self._torch_apply = apply_torch_generic
        self._torch_apply(logits, bm)

    def apply_mlx(self, logits, bm_np):
        try:
            import llguidance.mlx as lm

            out = lm.apply_token_bitmask(logits, bm_np)  # Metal kernel: only on Apple GPUs
            import mlx.core as mx

            mx.eval(out)
            self.mlx_native = True
            return out
        except Exception:
            return apply_mlx_generic(logits, bm_np)

    def advance(self, m, t):
        return m.consume_token(t)

    def advance_batch(self, ms, toks):
        return self.ex.consume_token_par(list(zip(ms, toks, strict=False)))

    def accepting(self, m):
        return m.is_accepting()

    def reset(self, m):
        m.reset()


class OC(Adapter):
    name = "outlines-core"

    def init(self, tok):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.build = oc, build_regex_from_schema
        m = {}
        for i, b in byte_vocab(tok).items():
            if i != tok.eos_token_id:
                m.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(tok.eos_token_id, m)
        self.cache = {}
        self._torch_apply = None

    def compile_cold(self, s, key):
        idx = self.oc.Index(self.build(s), self.vocab)  # regex DFA x vocabulary, fully precomputed
        self.cache[s] = idx
        return idx

    def compile_cached(self, s, key):
        return self.cache[s]

    def matcher(self, c):
        return self.oc.Guide(c)

    def fill(self, m, bm, row=0):
        v = bm[row]
        m.write_mask_into(v.data_ptr(), v.numel(), 4)

    def fill_batch(self, ms, bm):
        for i, m in enumerate(ms):  # no batched API
            v = bm[i]
            m.write_mask_into(v.data_ptr(), v.numel(), 4)

    def apply_torch(self, logits, bm):
        if self._torch_apply is None:
            try:
                from outlines_core.kernels.torch import apply_token_bitmask_inplace

                self._torch_apply = apply_token_bitmask_inplace
                self._torch_apply(logits.clone(), bm)
            except Exception as e:
                print(f"outlines torch kernel unavailable ({type(e).__name__}); generic", file=sys.stderr)
                self._torch_apply = apply_torch_generic
        self._torch_apply(logits, bm)

    def apply_mlx(self, logits, bm_np):
        try:
            import mlx.core as mx
            from outlines_core.kernels.mlx import apply_token_bitmask

            out = apply_token_bitmask(logits, bm_np)  # Metal kernel: only on Apple GPUs
            mx.eval(out)
            self.mlx_native = True
            return out
        except Exception:
            return apply_mlx_generic(logits, bm_np)

    def advance(self, m, t):
        try:
            m.advance(t, False)
            return True
        except ValueError:
            return False

    def advance_batch(self, ms, toks):
        return [self.advance(m, t) for m, t in zip(ms, toks, strict=False)]

    def accepting(self, m):
        return m.is_finished()

    def reset(self, m):
        m.reset()

    def eos_advances(self):
        return False  # Guide.advance(eos) raises: caller stops on EOS itself


ADAPTERS = {"xgr": XGR, "llg": LLG, "oc": OC}


def allowed_ids(bm_row):
    import numpy as np

    b = np.unpackbits(bm_row.numpy().view(np.uint8), bitorder="little")
    return np.nonzero(b)[0]


# ---------------------------------------------------------------- worker: one library
def worker(lib, args):
    import torch

    torch.set_num_threads(1)
    res = {"lib": lib}
    t = now()
    tok = load_tokenizer()
    res["hf_tokenizer_load_s"] = now() - t
    t = now()
    A = ADAPTERS[lib]()
    mod = {"xgr": "xgrammar", "llg": "llguidance", "oc": "outlines_core"}[lib]
    __import__(mod)
    res["import_s"] = now() - t
    t = now()
    A.init(tok)
    res["init_s"] = now() - t
    res["name"] = A.name

    bm1 = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    compiled, res["compile"], res["checks"] = {}, {}, {}
    for key, sch in SCHEMAS.items():
        s = json.dumps(sch)
        cold, first = [], []
        for _ in range(3):
            t = now()
            c = A.compile_cold(s, key)
            t1 = now()
            m = A.matcher(c)
            A.fill(m, bm1)
            t2 = now()
            cold.append(t1 - t)
            first.append(t2 - t)
        warm = []
        for _ in range(20):
            t = now()
            c = A.compile_cached(s, key)
            m = A.matcher(c)
            A.fill(m, bm1)
            warm.append(now() - t)
        compiled[key] = c
        res["compile"][key] = {
            "cold_ms": 1e3 * min(cold),
            "cold_to_first_mask_ms": 1e3 * min(first),
            "cached_to_first_mask_ms": 1e3 * sorted(warm)[len(warm) // 2],
        }
        # correctness: EOS not allowed at start; ids >= 50295 never allowed; valid doc accepted,
        # EOS allowed only at the end; invalid doc rejected
        ids = allowed_ids(bm1[0])
        chk = {"eos_at_start": bool(EOS in ids), "ids_over_tokenizer": int((ids >= 50295).sum())}
        good, bad = SAMPLES[key]
        for label, doc in (("valid", good), ("invalid", bad)):
            toks = tok(json.dumps(doc)).input_ids
            m = A.matcher(c)
            ok = True
            eos_mid = False
            for j, tid in enumerate(toks):
                A.fill(m, bm1)
                if j > 0 and EOS in allowed_ids(bm1[0]):
                    eos_mid = True
                if not A.advance(m, tid):
                    ok = False
                    break
            A.fill(m, bm1)
            chk[label] = {
                "all_tokens_ok": ok,
                "accepting": bool(ok and A.accepting(m)),
                "eos_allowed_at_end": bool(ok and EOS in allowed_ids(bm1[0])),
                "eos_allowed_midway": eos_mid,
            }
            if label == "valid" and ok and A.eos_advances():
                chk[label]["eos_consumed"] = bool(A.advance(m, EOS))
        res["checks"][key] = chk

    # invalid schemas
    res["invalid"] = {}
    for k, s in INVALID.items():
        try:
            A.compile_cold(s, k)
            res["invalid"][k] = "NO ERROR"
        except Exception as e:
            res["invalid"][k] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:140]}"

    # per-token loop, batch 1
    V = tok.get_vocab()
    inv = {i: s for s, i in V.items()}
    boost = torch.zeros(VOCAB)
    for i, s in inv.items():
        if any(ch in s for ch in '"}],'):
            boost[i] = 3.0  # make random walks close strings/containers, to exercise structure
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(64, VOCAB, generator=g) + boost
    try:
        import mlx.core as mx

        mx_pool = [mx.array(pool[i].numpy())[None] for i in range(8)]
    except Exception:
        mx_pool = None
    t = now()
    A.apply_torch(pool[:1].clone(), bm1)
    res["torch_apply_warmup_s"] = now() - t
    res["steps"] = {}
    for key in SCHEMAS:
        m = A.matcher(A.compile_cached(json.dumps(SCHEMAS[key]), key))
        tf, ta, tv, tm, tg, tot = [], [], [], [], [], []
        done = 0
        logits = torch.empty(1, VOCAB)
        for step in range(args.steps):
            logits.copy_(pool[step % 64])
            t = now()
            A.fill(m, bm1)
            t1 = now()
            A.apply_torch(logits, bm1)
            t2 = now()
            tid = int(logits.argmax())
            t3 = now()
            if tid == EOS:
                ok = A.advance(m, tid) if A.eos_advances() else True
                A.reset(m)
                done += 1
            else:
                ok = A.advance(m, tid)
            t4 = now()
            if not ok:
                raise RuntimeError(f"{lib}/{key}: allowed token {tid} rejected at step {step}")
            lg = pool[step % 64][None].clone()
            t5 = now()
            apply_torch_generic(lg, bm1)
            tg.append(now() - t5)
            if mx_pool is not None:
                t5 = now()
                A.apply_mlx(mx_pool[step % 8], bm1.numpy())
                tm.append(now() - t5)
            tf.append(t1 - t)
            ta.append(t2 - t1)
            tv.append(t4 - t3)
            tot.append((t1 - t) + (t2 - t1) + (t4 - t3))
        res["steps"][key] = {
            "total": stats(tot),
            "fill": stats(tf),
            "apply_torch": stats(ta),
            "advance": stats(tv),
            "apply_mlx": stats(tm),
            "apply_torch_generic_eager": stats(tg),
            "docs_completed": done,
        }
    res["mlx_native_kernel_used"] = A.mlx_native

    # batch of B matchers (mixed schemas), batched API where it exists
    B = args.batch
    keys = list(SCHEMAS)
    ms = [A.matcher(A.compile_cached(json.dumps(SCHEMAS[keys[i % 4]]), keys[i % 4])) for i in range(B)]
    bmB = torch.full((B, VOCAB // 32), -1, dtype=torch.int32)
    logitsB = torch.empty(B, VOCAB)
    A.apply_torch(pool[:B].clone() if B <= 64 else pool.repeat(B // 64 + 1, 1)[:B].clone(), bmB)  # warm-up
    tf, ta, tv, tot = [], [], [], []
    done = 0
    for step in range(args.batch_steps):
        logitsB.copy_(torch.roll(pool, step, 0)[:B] if B <= 64 else pool.repeat(B // 64 + 1, 1)[:B])
        t = now()
        A.fill_batch(ms, bmB)
        t1 = now()
        A.apply_torch(logitsB, bmB)
        t2 = now()
        toks = logitsB.argmax(1).tolist()
        t3 = now()
        eos_rows = [i for i, x in enumerate(toks) if x == EOS]
        if eos_rows and not A.eos_advances():
            adv = [i for i in range(B) if i not in set(eos_rows)]
            oks = A.advance_batch([ms[i] for i in adv], [toks[i] for i in adv])
        else:
            oks = A.advance_batch(ms, toks)
        for i in eos_rows:
            A.reset(ms[i])
            done += 1
        t4 = now()
        if not all(oks):
            raise RuntimeError(f"{lib}: batch advance rejected an allowed token at step {step}")
        tf.append(t1 - t)
        ta.append(t2 - t1)
        tv.append(t4 - t3)
        tot.append(t4 - t3 + t2 - t)
    res["batch"] = {
        "B": B,
        "total": stats(tot),
        "fill": stats(tf),
        "apply_torch": stats(ta),
        "advance": stats(tv),
        "docs_completed": done,
    }
    res["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(res))


# ---------------------------------------------------------------- worker: one pathological case
def patho(lib, case):
    import torch

    tok = load_tokenizer()
    A = ADAPTERS[lib]()
    A.init(tok)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s = json.dumps(patho_schema(case))
    bm = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    t = now()
    try:
        c = A.compile_cold(s, case)
        t1 = now()
        m = A.matcher(c)
        A.fill(m, bm)
        out = {"status": "ok", "compile_ms": 1e3 * (t1 - t), "to_first_mask_ms": 1e3 * (now() - t)}
        if lib == "llg" and m.is_error():
            out = {"status": "error", "ms": 1e3 * (now() - t), "msg": m.get_error().splitlines()[0][:140]}
    except Exception as e:
        out = {
            "status": "error",
            "ms": 1e3 * (now() - t),
            "msg": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:140] if str(e).strip() else ''}",
        }
    out["rss_delta_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    print("RESULT " + json.dumps(out))


# ---------------------------------------------------------------- driver
def run_sub(argv, timeout):
    env = dict(os.environ)
    t = now()
    try:
        p = subprocess.run(
            [sys.executable, os.path.abspath(__file__)] + argv, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "ms": 1e3 * (now() - t)}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"status": "crash", "rc": p.returncode, "msg": (p.stderr.strip().splitlines() or [""])[-1][:200]}


def f(x, k="mean_ms"):
    return f"{x[k]:.3f}" if x and k in x else "-"


def table(results, patho_res):
    libs = [r for r in results if "name" in r]
    L = []
    L.append("| metric | " + " | ".join(r["name"] for r in libs) + " |")
    L.append("|---|" + "---|" * len(libs))

    def row(name, vals):
        L.append(f"| {name} | " + " | ".join(vals) + " |")

    row("import (s)", [f"{r['import_s']:.2f}" for r in libs])
    row("tokenizer/compiler init (s)", [f"{r['init_s']:.2f}" for r in libs])
    for k in SCHEMAS:
        row(f"{k}: compile cold (ms)", [f"{r['compile'][k]['cold_ms']:.1f}" for r in libs])
        row(f"{k}: cold→first mask (ms)", [f"{r['compile'][k]['cold_to_first_mask_ms']:.1f}" for r in libs])
        row(f"{k}: cached→first mask (ms)", [f"{r['compile'][k]['cached_to_first_mask_ms']:.2f}" for r in libs])
    for k in SCHEMAS:
        row(
            f"{k}: B=1 fill+apply+advance mean/p50/p99 (ms)",
            [
                f"{f(r['steps'][k]['total'])}/{f(r['steps'][k]['total'], 'p50_ms')}"
                f"/{f(r['steps'][k]['total'], 'p99_ms')}"
                for r in libs
            ],
        )
        row(
            f"{k}: B=1 fill p99 / max (ms)",
            [f"{f(r['steps'][k]['fill'], 'p99_ms')} / {f(r['steps'][k]['fill'], 'max_ms')}" for r in libs],
        )
        row(
            f"{k}: B=1 fill / torch apply / advance mean (ms)",
            [
                f"{f(r['steps'][k]['fill'])} / {f(r['steps'][k]['apply_torch'])} / {f(r['steps'][k]['advance'])}"
                for r in libs
            ],
        )
        row(f"{k}: B=1 mlx apply mean (ms)", [f(r["steps"][k]["apply_mlx"]) for r in libs])
        row(
            f"{k}: B=1 generic eager torch apply mean (ms)",
            [f(r["steps"][k]["apply_torch_generic_eager"]) for r in libs],
        )
        row(f"{k}: docs completed in B=1 run", [str(r["steps"][k]["docs_completed"]) for r in libs])
    row(
        "B=64 step mean/p50/p99 (ms)",
        [
            f"{f(r['batch']['total'])}/{f(r['batch']['total'], 'p50_ms')}/{f(r['batch']['total'], 'p99_ms')}"
            for r in libs
        ],
    )
    row(
        "B=64 fill p99 / max (ms)",
        [f"{f(r['batch']['fill'], 'p99_ms')} / {f(r['batch']['fill'], 'max_ms')}" for r in libs],
    )
    row(
        "B=64 fill / torch apply / advance mean (ms)",
        [f"{f(r['batch']['fill'])} / {f(r['batch']['apply_torch'])} / {f(r['batch']['advance'])}" for r in libs],
    )
    row("torch apply kernel warm-up (s)", [f"{r['torch_apply_warmup_s']:.2f}" for r in libs])
    row("B=64 docs completed", [str(r["batch"]["docs_completed"]) for r in libs])
    row("mlx kernel", ["native" if r["mlx_native_kernel_used"] else "generic mx (lib's is Metal-only)" for r in libs])
    for k in SCHEMAS:
        row(f"{k}: checks", [json.dumps(r["checks"][k], separators=(",", ":")) for r in libs])
    for k in INVALID:
        row(f"invalid {k}", [r["invalid"][k].replace("|", "\\|") for r in libs])
    row("peak RSS of bench process (MB)", [f"{r['maxrss_mb']:.0f}" for r in libs])
    if not libs:
        L = []
    if patho_res:
        names = {k: v.name for k, v in ADAPTERS.items()}
        plibs = list(patho_res)
        L.append("")
        L.append("| pathological schema (compile + first mask) | " + " | ".join(names[lib] for lib in plibs) + " |")
        L.append("|---|" + "---|" * len(plibs))
        for case in patho_res[plibs[0]]:
            vals = []
            for lib in plibs:
                p = patho_res[lib].get(case, {})
                if p.get("status") == "ok":
                    vals.append(f"ok {p['to_first_mask_ms']:.0f} ms, +{p['rss_delta_mb']:.0f} MB")
                elif p.get("status") == "error":
                    vals.append(f"error {p['ms']:.0f} ms: {p.get('msg', '')}".replace("|", "\\|"))
                else:
                    vals.append(f"{p.get('status')} {p.get('ms', 0):.0f} ms {p.get('msg', '')}".replace("|", "\\|"))
            L.append(f"| {case} | " + " | ".join(vals) + " |")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--libs", default="xgr,llg,oc")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-steps", type=int, default=100)
    ap.add_argument("--patho-timeout", type=float, default=30)
    ap.add_argument("--patho-cases", default=",".join(PATHO))
    ap.add_argument("--no-patho", action="store_true")
    ap.add_argument("--no-main", action="store_true", help="only the pathological cases")
    ap.add_argument("--out", default=os.path.join(HERE, "results.json"))
    ap.add_argument("--worker")
    ap.add_argument("--patho", nargs=2)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args)
    if args.patho:
        return patho(*args.patho)
    results, pres = [], {}
    for lib in args.libs.split(","):
        r = (
            {"status": "skipped"}
            if args.no_main
            else run_sub(
                [
                    "--worker",
                    lib,
                    "--steps",
                    str(args.steps),
                    "--batch",
                    str(args.batch),
                    "--batch-steps",
                    str(args.batch_steps),
                ],
                600,
            )
        )
        r.setdefault("lib", lib)
        results.append(r)
        print(lib, "done", r.get("status", "ok"), r.get("msg", ""), file=sys.stderr, flush=True)
        if not args.no_patho:
            pres[lib] = {}
            for case in args.patho_cases.split(","):
                pres[lib][case] = run_sub(["--patho", lib, case], args.patho_timeout)
                print(" ", lib, case, pres[lib][case], file=sys.stderr, flush=True)
    json.dump({"results": results, "patho": pres}, open(args.out, "w"), indent=1)
    print(table(results, pres))


if __name__ == "__main__":
    main()
