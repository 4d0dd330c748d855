"""This machine's physical limits for a decode step, measured once and cached: the memory read bandwidth and the
float32 FMA rate torch reaches on its threads. ``python -m pipeline.bench_step`` prints, beside each figure, the floor
they imply (``floor_ms``): a forward can be no faster than reading its weights once, nor than its products at that
rate.
"""

from __future__ import annotations

import logging

import torch

from pipeline.costs import store, time_points

log = logging.getLogger(__name__)

READ_MB = 512  # bytes read per bandwidth sample: far beyond any last-level cache
GEMM_N = 1536  # square float32 GEMM of the FMA-rate sample (MKL / oneDNN near their peak)


def measure_limits(read_mb: int = READ_MB, gemm_n: int = GEMM_N, rounds: int = 5) -> dict:
    """{"read_gb_s": bytes read per second by a sum over ``read_mb`` MB (GB/s), "gflop_s": float32 multiply-adds x 2
    per second of an ``gemm_n``-square GEMM}, each the best of ``rounds`` interleaved samples on torch's threads."""
    data = torch.ones(read_mb * 2**20 // 4)
    a, b = torch.randn(gemm_n, gemm_n), torch.randn(gemm_n, gemm_n)
    out = torch.empty(gemm_n, gemm_n)
    timings = time_points({"read": lambda: data.sum(), "gemm": lambda: torch.mm(a, b, out=out)}, rounds=rounds, warmup=1)
    return {"read_gb_s": round(data.numel() * 4 / (timings["read"].ms / 1e3) / 1e9, 2),
            "gflop_s": round(2 * gemm_n**3 / (timings["gemm"].ms / 1e3) / 1e9, 1)}


def machine_limits() -> dict:
    """``measure_limits()`` for this machine, cached in the one per-machine store (``pipeline.costs.store``) under the
    host (``store.key``: its CPU model, torch's thread count and version)."""
    key = store.key("machine-limits", read_mb=READ_MB, gemm_n=GEMM_N)

    def measure() -> dict:
        log.info("measuring this machine's read bandwidth and FMA rate (once, a few seconds)")
        return measure_limits()

    def check(stored: dict) -> str | None:
        ok = all(isinstance(stored.get(k), (int, float)) and stored[k] > 0 for k in ("read_gb_s", "gflop_s"))
        return None if ok else "it holds no bandwidth and FMA rate"

    try:
        return store.cached(store.default_dir(), key, "limits", measure, check)
    except OSError as err:
        log.warning("could not cache the machine's limits (%s)", err)
        return measure()


def floor_ms(weight_bytes: float, params: float, rows: int, limits: dict) -> float:
    """The least ms a forward over ``rows`` rows can take: reading ``weight_bytes`` once at ``read_gb_s``, or its
    ``2 * rows * params`` float32 FLOPs at ``gflop_s``, whichever is longer."""
    read = weight_bytes / (limits["read_gb_s"] * 1e9) * 1e3
    fma = 2.0 * rows * params / (limits["gflop_s"] * 1e9) * 1e3
    return max(read, fma)


def weight_footprint(decoder) -> tuple[float, float]:
    """(bytes a target forward streams, multiply-adds per row) of ``decoder``'s target: its decoder layers' linears and
    LM head, in the packed form its backend reads (``SmallmWeight.nbytes`` on smallm), else their own dtype."""
    from pipeline.models.backend import PackedLinear

    total_bytes = params = 0.0
    weights = [m for m in decoder.base.layers.modules() if isinstance(m, torch.nn.Linear)]
    for lin in weights:
        params += lin.weight.numel()
        packed = lin._bp_packed.get() if type(lin) is PackedLinear else None
        total_bytes += getattr(packed, "nbytes", lin.weight.numel() * lin.weight.element_size())
    head = decoder.head  # a LogitHead: its product an LMHead (a packed copy on packed backends) or an int8 head
    params += head.weight.numel()
    total_bytes += head.nbytes
    return total_bytes, params
