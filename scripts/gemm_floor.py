"""The GEMM floor of one decode step on this machine (a benchmark that prints figures; not a test).

    python scripts/gemm_floor.py [--rows 1 2 4 9 16] [--repeats 15]

Packs every linear weight of the embedded target (and its LM head) in smallm's exact forms at every row count
(``smallm``: 4-bit / 8-bit, without the float32 panels the default keeps for calls of more than 3 rows) and in
float32 panels (``smallm_f32``), and times only the matrix products
of one forward over M rows, back to back, with no model code around them: the least a target forward
over M tokens can cost here. Prints, per backend and M, the median ms, the weight bytes streamed and the
arithmetic rate (2 * params * M flops).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from safetensors.torch import load_file

from pipeline.models.backend import SMALLM_MAX_ROWS, pack_smallm
from pipeline.models.target import cache_embedded_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 9, 16])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    state = load_file(str(cache_embedded_target() / "model.safetensors"))
    weights = [w for name, w in state.items() if w.dim() == 2 and "embed" not in name]
    weights.append(state["model.embed_tokens.weight"])  # the tied LM head
    params = sum(w.numel() for w in weights)
    print(f"{len(weights)} weights, {params / 1e6:.1f}M parameters")
    for backend, formats in (("smallm", None), ("smallm_f32", ())):
        packed = [pack_smallm(w, exact_rows=SMALLM_MAX_ROWS) if formats is None else pack_smallm(w, formats) for w in weights]
        nbytes = sum(p.nbytes for p in packed)
        for m in args.rows:
            xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
            times = []
            for i in range(args.repeats + 2):
                t0 = time.perf_counter()
                for p, w in zip(packed, weights):
                    p(xs[w.shape[1]], None)
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(times)
            print(f"{backend:10s} M={m:2d}: {ms:6.1f} ms  ({nbytes / 1e6:.0f} MB streamed, "
                  f"{2 * params * m / ms / 1e6:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
