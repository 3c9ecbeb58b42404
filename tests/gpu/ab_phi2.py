r"""Phi-2 at batch 1 and 64 on one H200: the decoder before the families work (813c117's
backends, copied as `oldbackends`) against the current one, alternating, in one process.

    mkdir -p abtest/oldbackends
    for f in $(git ls-tree --name-only 813c117 backends/); do
        git show 813c117:$f > abtest/oldbackends/$(basename $f)
    done
    sed -i 's/from backends\./from oldbackends./g; s/from backends import/from oldbackends import/g' \
        abtest/oldbackends/*.py
    python3 tests/gpu/ab_phi2.py
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "abtest")]
# E402: these imports need the repository and abtest/ on sys.path, set just above.
import oldbackends.torch_fast as old  # noqa: E402
import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

backend = load_backend("torch", LoadOptions(model="random:phi-2", device="cuda", dtype="bfloat16", warmup=False))
new_weights = backend.decoder_weights
old_weights = old.PhiWeights(backend.model, new_weights.decodable, backend.info.context_length)
prompt = list(range(5, 21))


def timed(make, batch):
    decoder = make(batch)
    decoder.capture(spans=(128, 256))
    decoder.clear()
    for i in range(batch):
        decoder.add(Sequence(i, prompt, Sampling(), 300))
    while any(s.next_token is None for s in decoder.rows):
        decoder.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        decoder.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 200 * 1000


results = {}
for batch in (1, 64):
    for _ in range(3):
        for name, make in (
            ("before", lambda b: old.BatchedPhiDecoder(old_weights, b)),
            ("now", lambda b: BatchedDecoder(new_weights, b)),
        ):
            ms = timed(make, batch)
            results.setdefault((batch, name), []).append(ms)
            torch.cuda.empty_cache()
for (batch, name), values in sorted(results.items()):
    print(
        f"batch {batch} {name}: step ms {[round(v, 3) for v in values]} -> median {sorted(values)[1]:.3f} ms "
        f"= {batch * 1000 / sorted(values)[1]:.0f} tok/s"
    )
