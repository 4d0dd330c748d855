"""The forward path every decoder forward runs on: ``eager``, ``onednn`` or ``smallm``.

On a CPU a decode step multiplies 1-16 token rows (an autoregressive step, a draft, a verify) with
every weight, so it is bound by reading the weights; PyTorch's float32 ``nn.Linear`` goes to MKL, whose
GEMMs for a few rows cost ~2x a 1-row GEMV, and whose results for a row depend on how many rows share
the call. The backends:

- ``eager``: PyTorch's own kernels, unchanged.
- ``onednn``: each weight reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's freezing pass uses) and run with
  ``torch.ops.mkldnn._linear_pointwise``.
- ``smallm``: this project's AVX2 kernel (``kernels/smallm.cpp``, compiled on first use by ``pipeline.models.kernel`` with
  ``torch.utils.cpp_extension``, ~45 s once, cached under ``~/.cache/torch_extensions``): weights
  packed in 16-column panels that are streamed once per call for all rows (up to ``SMALLM_MAX_ROWS``;
  larger inputs, such as a prefill, take PyTorch's GEMM). Every output is one sequential FMA chain over
  K, so a row's result is bit-identical alone or with 15 others: the verify computes exactly what the
  autoregressive step would. Each weight is stored in the smallest form that holds its float32 values
  exactly (``exact_format``): ``q4`` (blocks of 32 along K, w = d * q + m, q in 0..15: the values of a
  GGUF Q4_1 tensor), ``q8`` (w = d * q, q int8: GGUF Q8_0), ``bf16`` (a bf16-trained drafter), else
  ``f32``. The kernel expands them in registers to the same float32 values, so the outputs equal the
  float32 kernel's bit for bit while a step reads ~5x fewer bytes; every packing is checked by expanding
  it back (``unpack_exact``) and falls back to ``f32`` on any difference. Each expanded weight is used at
  once by every row of a tile of up to 6 (a 2-6 token verify costs about what a 1-token step does). Where
  streaming float32 panels beats the exact forms (only at many rows, and not on every CPU) is measured
  once per machine (``exact_crossover``) and float32 panels are kept only for the widths that use them.
- ``smallm_f32``: the same kernel with every weight in float32 panels (the comparison point).

Packed backends also make transformers' SDPA attention run grouped-query attention natively for every
query length (``TRANSFORMERS_SDPA_FORCE_GQA=1``): by default it does so only without a mask (one-token
steps) and copies the whole KV cache ``num_heads / num_kv_heads`` times for masked multi-token verifies,
which cost SmolLM2 more than the verify's extra GEMM work.

The backend is set on the loaded modules (``set_backend``), so the target's autoregressive steps, its
verify steps, the prefill and the drafter all take the same path: speedups compare like with like. The
weights are not changed (a packed copy sits beside each one); a weight that changes after packing
(training) is repacked on its next use, and any call that needs gradients runs plain ``F.linear``.

``auto`` = ``smallm`` for float32 on an AVX2 CPU when the kernel builds, else ``onednn`` for float32 on
CPU, else ``eager``. Measured choices: ``python -m pipeline.bench_step`` (README, "Speed on CPU").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.models.kernel import (LOCK_WAIT_ENV, LOCK_WAIT_S, SMALLM_SOURCE as _KERNEL, KernelUnavailableError,  # noqa: F401
                                    kernel_failure, smallm_kernel)

log = logging.getLogger(__name__)

BACKENDS = ("auto", "eager", "onednn", "smallm", "smallm_f32")
PACKED = ("onednn", "smallm", "smallm_f32")  # backends that keep a packed copy of each weight
SMALLM = ("smallm", "smallm_f32")  # the backends on this project's kernel
EXACT_FORMATS = ("q4", "q8", "bf16")  # smallm's compressed forms, tried in this order (then f32)
_FORMAT_CODE = {"bf16": 1, "q8": 2, "q4": 3}  # kernels/smallm.cpp's Format
_GROUP = 32  # the q4/q8 block length along K
SMALLM_MAX_ROWS = 32  # smallm runs inputs of up to this many rows; more go to PyTorch's GEMM
# Calls of more rows than a format's crossover use float32 panels kept beside the exact form (same bits). Where the
# crossover lies depends on the CPU (docs/cpu_backend.md): ``exact_crossover`` measures it once per machine.
EXACT_ROWS_ENV = "BLOCKPILOT_SMALLM_EXACT_ROWS"  # an int forces every format's crossover (no measurement)
_TUNE_ROWS = (2, 3, 4, 6, 8, 12, 16, 24, 32)




def backend_signature(backend: str) -> str:
    """``backend`` plus a hash of the code its timings depend on (the smallm kernel's source and formats), so a
    cached latency model measured on an older kernel is not reused."""
    if backend not in SMALLM:
        return backend
    crossover = exact_crossover() if backend == "smallm" else {}
    isa = smallm_kernel().isa()
    digest = hashlib.sha256(_KERNEL.read_bytes() + repr((EXACT_FORMATS, crossover, isa)).encode()).hexdigest()[:8]
    return f"{backend}:{digest}"


def _time_pair_ms(first, second, weights, repeats: int = 7, warmup: int = 2) -> tuple[float, float]:
    """The least ms of one pass of ``first`` and of ``second`` over ``weights``, the two interleaved round by round (the
    one timer of every per-machine measurement, ``pipeline.costs.timer``)."""
    from pipeline.costs import time_points

    def over(fn):
        return lambda: [fn(w) for w in weights]

    timings = time_points({"first": over(first), "second": over(second)}, rounds=repeats, warmup=warmup)
    return timings["first"].ms, timings["second"].ms


def measure_crossover(n: int = 1536, k: int = 576, megabytes: float = 160.0, rows=_TUNE_ROWS,
                      timings: dict | None = None) -> dict[str, int]:
    """Per exact format, the crossover T (rows) that makes a pass at every row count of ``rows`` cheapest in total,
    calls of up to T rows streaming the exact form and wider ones float32 panels; ``SMALLM_MAX_ROWS`` when the exact
    form is cheapest throughout. A total, not the first loss, so one noisy row count does not move T.

    Times one pass over enough random [n, k] weights to hold ``megabytes`` of float32 panels (more than a CPU's
    last-level cache, as a target's weights are), in both forms interleaved, at each row count. About 5 s.

    Returns:
        {"q4": T, "q8": T, "bf16": T}; ``timings`` (when given) gets {fmt: {rows: [exact ms, float32 ms]}}.
    """
    kernel = smallm_kernel()
    gen = torch.Generator().manual_seed(0)
    count = max(4, int(megabytes * 2**20 / (n * k * 4)))
    p, g = (n + 15) // 16, k // _GROUP
    rows = sorted(rows)
    out = {}
    for fmt in EXACT_FORMATS:
        if fmt == "q4":
            q = torch.randint(0, 256, (p, k, 8), dtype=torch.uint8, generator=gen)
        elif fmt == "q8":
            q = torch.randint(-128, 128, (p, k, 16), dtype=torch.int8, generator=gen)
        else:
            q = torch.randn(p * 16, k, generator=gen).bfloat16().view(torch.int16)
            q = q.view(p, 16, k).transpose(1, 2).contiguous()
        d = torch.rand(p, g, 16, generator=gen) * 0.01 if fmt != "bf16" else torch.empty(0)
        m = torch.rand(p, g, 16, generator=gen) * 0.01 if fmt == "q4" else torch.empty(0)
        weights = [SmallmWeight(fmt, q.clone(), d.clone(), m.clone(), n, torch.randn(p, k, 16, generator=gen))
                   for _ in range(count)]
        exact, f32 = [], []
        for rows_m in rows:
            x = torch.randn(rows_m, k, generator=gen)
            e, f = _time_pair_ms(lambda w: kernel.linear_exact(x, _FORMAT_CODE[fmt], w.q, w.d, w.m, n, None),
                                 lambda w: kernel.linear(x, w.f32, n, None), weights)
            exact.append(e)
            f32.append(f)
            if timings is not None:
                timings.setdefault(fmt, {})[rows_m] = [round(e, 3), round(f, 3)]
        # total over the row counts when calls of up to rows[i] rows stream the exact form (i = -1: none of them)
        totals = [sum(exact[: i + 1]) + sum(f32[i + 1:]) for i in range(-1, len(rows))]
        best = min(range(len(totals)), key=lambda i: (totals[i], -i))  # ties go to the exact form (less memory)
        out[fmt] = 1 if best == 0 else SMALLM_MAX_ROWS if best == len(rows) else rows[best - 1]
        del weights
    return out


@functools.lru_cache(maxsize=1)
def exact_crossover() -> dict[str, int]:
    """Per exact format (``q4``, ``q8``, ``bf16``), the most rows a call may have and still stream the exact form;
    wider calls use float32 panels (the same bits). ``SMALLM_MAX_ROWS`` means never (no float32 panels are kept).

    ``$BLOCKPILOT_SMALLM_EXACT_ROWS`` (an int) sets every format's; otherwise it is measured once per machine
    (``measure_crossover``, ~5 s, on the one timer of ``pipeline.costs.timer``) and kept in the one per-machine cache
    (``pipeline.costs.store``: ``data/cache/costs/``, or ``$BLOCKPILOT_COST_CACHE``) under a key of the kernel source
    and this host (``store.key``: the CPU model, torch's thread count and version).

    Raises:
        ValueError: when the environment variable is not a positive int.
    """
    forced = os.environ.get(EXACT_ROWS_ENV)
    if forced is not None:
        try:
            value = int(forced)
            if value < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"${EXACT_ROWS_ENV} must be a positive int (rows), got {forced!r}; unset it to measure") from None
        return {fmt: min(value, SMALLM_MAX_ROWS) for fmt in EXACT_FORMATS}
    from pipeline.costs import store

    key = store.key("smallm-crossover", kernel=hashlib.sha256(_KERNEL.read_bytes()).hexdigest()[:12],
                    isa=smallm_kernel().isa(), formats=list(EXACT_FORMATS), rows=list(_TUNE_ROWS))

    measured: dict = {}

    def measure() -> dict:
        log.info("smallm: measuring where float32 panels beat the exact forms on this CPU (once, ~5 s)")
        timings: dict = {}
        found = measure_crossover(timings=timings)
        measured.update(crossover=found, ms_exact_f32={f: {str(r): v for r, v in t.items()} for f, t in timings.items()})
        return measured

    def check(stored: dict) -> str | None:
        found = stored.get("crossover") or {}
        ok = set(found) == set(EXACT_FORMATS) and all(isinstance(v, int) and v >= 1 for v in found.values())
        return None if ok else "it holds no crossover per format"

    try:
        data = store.cached(store.default_dir(), key, "crossover", measure, check)
    except OSError as err:  # an unwritable cache folder: measured every process (once: kept if already measured)
        log.warning("smallm: could not cache the crossover (%s)", err)
        data = measured or measure()
    return dict(data["crossover"])


def smallm_available() -> bool:
    """True when the ``smallm`` kernel builds and loads here (the first call may take ~45 s; a failure is warned once
    and remembered, see ``smallm_kernel``)."""
    try:
        smallm_kernel()
        return True
    except KernelUnavailableError:
        return False


def batch_invariant(backend: str) -> bool:
    """True when ``backend``'s forwards give each row the same bits whatever the number of rows in the call, so a
    B-row verify computes exactly what B autoregressive steps would and float32 decoding is lossless by construction:
    the packed CPU backends (``onednn``, ``smallm``, ``smallm_f32``; tested row by row). ``eager`` (PyTorch's GEMMs,
    MKL or cuBLAS) picks kernels by shape, so its outputs can differ in the last bits between a verify and a step:
    measure its exact-match rate instead (``bench_label check=true``)."""
    return backend in PACKED


def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN (MKL-DNN) CPU kernels."""
    return bool(torch.backends.mkldnn.is_available())


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``auto`` -> ``smallm``, ``onednn`` or ``eager`` (see the module doc); other names are checked.

    Raises:
        ValueError: for an unknown backend, a packed backend off the CPU or not in float32, or one that
            cannot run on this machine (``KernelUnavailableError`` for ``smallm`` without its kernel).
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.backend must be one of {list(BACKENDS)}, got {backend!r}")
    on_cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if backend == "auto":
        if not on_cpu_fp32:
            return "eager"
        if smallm_available():
            return "smallm"
        return "onednn" if onednn_available() else "eager"
    if backend in PACKED and not on_cpu_fp32:
        raise ValueError(f"model.backend={backend} runs float32 on CPU only (got {dtype} on {device}); "
                         "use model.backend=eager or auto")
    if backend == "onednn" and not onednn_available():
        raise ValueError("model.backend=onednn needs a PyTorch build with oneDNN (torch.backends.mkldnn); "
                         "use model.backend=eager")
    if backend in SMALLM:
        smallm_kernel()  # KernelUnavailableError is a ValueError naming the fix
    return backend


def _f16_near(x: torch.Tensor, offsets) -> list[torch.Tensor]:
    """float32 copies of ``x`` rounded to float16 and moved by each of ``offsets`` float16 steps."""
    bits = x.half().view(torch.int16)
    return [(bits + i).view(torch.float16).float() for i in offsets]


def _affine_blocks(w: torch.Tensor, signed: bool):
    """(q, d, m) with ``w == (d * q) + m`` (q4: q in 0..15) or ``w == d * q`` (q8: q in -128..127, m None),
    bit for bit, in blocks of 32 along K; None when some block is not of that form.

    The scale of a GGUF block is a float16 near its range / 15 (q4) or absmax / 127 (q8) and a q4 block's
    minimum is its offset (a float16), so a few float16 candidates around those are tried for each block.
    """
    n, k = w.shape
    if n > 64 and _affine_blocks(w[:64], signed) is None:  # a quick refusal on a few rows first
        return None
    blocks = w.view(n, k // _GROUP, _GROUP)
    bits = blocks.view(torch.int32)
    if signed:
        m, estimate, lo, hi = None, blocks.abs().amax(-1, keepdim=True) / 127, -128, 127
    else:
        m = blocks.amin(-1, keepdim=True)
        estimate, lo, hi = (blocks.amax(-1, keepdim=True) - m) / 15, 0, 15
    found = torch.zeros(n, k // _GROUP, 1, dtype=torch.bool)
    q_out, d_out = torch.zeros_like(blocks), torch.zeros_like(estimate)
    for d in _f16_near(estimate, (0, -1, 1, -2, 2)):
        positive = d > 0
        q = torch.round((blocks if signed else blocks - m) / torch.where(positive, d, 1.0)).clamp_(lo, hi)
        q = torch.where(positive, q, 0.0) + 0.0  # no -0.0: the kernel's integer q converts to +0.0
        rebuilt = d * q if signed else (d * q) + m  # two roundings, as the kernel computes it
        ok = (rebuilt.view(torch.int32) == bits).all(-1, keepdim=True) & ~found
        if m is not None:  # a GGUF Q4_1 block's offset is a float16 (linear_q4_int8 streams it so)
            ok &= m.half().float() == m
        q_out, d_out = torch.where(ok, q, q_out), torch.where(ok, d, d_out)
        found |= ok
        if bool(found.all()):
            return q_out.view(n, k), d_out.view(n, -1), None if signed else m.view(n, -1)
    return None


def _panels(t: torch.Tensor, width: int = 16) -> torch.Tensor:
    """[N, C] -> [ceil(N / 16), C, 16], zero-padded past N (the kernel's panel layout)."""
    n, c = t.shape
    p = (n + width - 1) // width
    padded = t.new_zeros(p * width, c)
    padded[:n] = t
    return padded.view(p, width, c).transpose(1, 2).contiguous()


class SmallmWeight:
    """One weight [N, K] packed for the smallm kernel in ``fmt`` (``f32``, ``bf16``, ``q8`` or ``q4``).

    Attributes:
        fmt: the stored form; q: the panels ([P, K, 16] float32 / uint16 / int8, or [P, K, 8] uint8 for q4);
        d, m: [P, K / 32, 16] float32 block scales and offsets (empty when unused); n: N; nbytes: bytes streamed
        per call of up to ``exact_rows`` rows; f32: float32 panels kept beside an exact form for calls of more
        rows (None for ``f32``, or when not kept); exact_rows: the most rows a call streams the exact form for.
    """

    __slots__ = ("fmt", "q", "d", "m", "n", "nbytes", "f32", "exact_rows")

    def __init__(self, fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int,
                 f32: torch.Tensor | None = None, exact_rows: int = SMALLM_MAX_ROWS):
        self.fmt, self.q, self.d, self.m, self.n, self.f32, self.exact_rows = fmt, q, d, m, n, f32, exact_rows
        self.nbytes = sum(t.numel() * t.element_size() for t in (q, d, m))

    def dense(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel computes with."""
        if self.fmt == "f32":
            return self.q.transpose(1, 2).reshape(-1, self.q.shape[1])[: self.n]
        return smallm_kernel().unpack_exact(_FORMAT_CODE[self.fmt], self.q, self.d, self.m, self.q.shape[1])[: self.n]

    def wide(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """y [M, N] = x [M, K] @ W.T (+ bias) for a call of any number of rows (a prefill) on float32 panels, or None
        when this weight keeps none (its exact form won at every width up to ``SMALLM_MAX_ROWS``)."""
        panels = self.q if self.fmt == "f32" else self.f32
        return None if panels is None else smallm_kernel().linear(x, panels, self.n, bias)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y [M, N] = x [M, K] @ W.T (+ bias), float32."""
        if self.fmt == "f32":
            return smallm_kernel().linear(x, self.q, self.n, bias)
        if self.f32 is not None and x.shape[0] > self.exact_rows:
            return smallm_kernel().linear(x, self.f32, self.n, bias)
        return smallm_kernel().linear_exact(x, _FORMAT_CODE[self.fmt], self.q, self.d, self.m, self.n, bias)


def exact_format(w: torch.Tensor) -> str | None:
    """The smallest of ``EXACT_FORMATS`` that holds every float32 value of ``w`` [N, K] exactly, else None."""
    if w.dim() != 2 or w.dtype != torch.float32:
        return None
    fmt = pack_smallm(w, exact_rows=SMALLM_MAX_ROWS).fmt
    return None if fmt == "f32" else fmt


def pack_smallm(w: torch.Tensor, formats=EXACT_FORMATS, exact_rows: int | None = None) -> SmallmWeight:
    """Pack ``w`` [N, K] float32 in the first of ``formats`` that holds it exactly (checked by expanding the
    packing back, bit for bit), else in float32 panels. Calls of more than ``exact_rows`` rows (default: this
    machine's ``exact_crossover()`` for the format) use float32 panels kept beside the exact form; none are kept
    when ``exact_rows >= SMALLM_MAX_ROWS``.

    Raises:
        ValueError: when ``w`` is not a 2-D float32 tensor.
    """
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"smallm packs 2-D float32 weights, got {tuple(w.shape)} {w.dtype}")
    w = w.detach().contiguous()
    n, k = w.shape
    empty = torch.empty(0)
    for fmt in formats if k % _GROUP == 0 else ():
        if fmt == "bf16":
            if not bool(((w.view(torch.int32) & 0xFFFF) == 0).all()):
                continue
            packed = SmallmWeight(fmt, _panels((w.view(torch.int32) >> 16).to(torch.int16)), empty, empty, n)
        else:
            found = _affine_blocks(w, signed=fmt == "q8")
            if found is None:
                continue
            q, d, m = found
            if fmt == "q8":
                packed = SmallmWeight(fmt, _panels(q.to(torch.int8)), _panels(d), empty, n)
            else:
                nib = _panels(q.to(torch.uint8))
                packed = SmallmWeight(fmt, (nib[..., :8] | (nib[..., 8:] << 4)).contiguous(), _panels(d), _panels(m), n)
        if torch.equal(packed.dense().view(torch.int32), w.view(torch.int32)):
            packed.exact_rows = exact_crossover()[fmt] if exact_rows is None else exact_rows
            if packed.exact_rows < SMALLM_MAX_ROWS:
                packed.f32 = smallm_kernel().pack(w)
            return packed
        log.warning("smallm: a %s packing of a %s weight did not expand back exactly; using float32", fmt, tuple(w.shape))
    return SmallmWeight("f32", smallm_kernel().pack(w), empty, empty, n)


def weight_version(weight: torch.Tensor) -> int:
    """The in-place version counter of ``weight``, which packed copies compare to know when to repack; -2 for an
    inference tensor (a model loaded under ``torch.inference_mode``), which has no counter: it is packed once, and an
    in-place edit of it is not seen (``set_backend`` again after one)."""
    return -2 if weight.is_inference() else weight._version


class _Packed:
    """A weight [N, K] packed for ``kind`` (``onednn`` | ``smallm`` | ``smallm_f32``), repacked when the weight changes."""

    __slots__ = ("weight", "kind", "version", "packed")

    def __init__(self, weight: torch.Tensor, kind: str):
        if kind not in PACKED:
            raise ValueError(f"packed weights are for {PACKED}, got {kind!r}")
        self.weight, self.kind = weight, kind
        self.version = -1
        self.packed = None

    def get(self):
        if self.version != weight_version(self.weight) or self.packed is None:
            with torch.no_grad():
                w = self.weight.detach().contiguous()
                if self.kind == "onednn":
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
                else:
                    self.packed = pack_smallm(w, EXACT_FORMATS if self.kind == "smallm" else ())
            self.version = weight_version(self.weight)
        return self.packed


def packed_linear(x: torch.Tensor, packed: _Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through a packed weight; x [..., K] -> [..., N] (float32).

    Gradient-tracking calls run ``F.linear``. ``smallm`` calls of more than ``SMALLM_MAX_ROWS`` rows (a prefill) run the
    kernel's float32 panels in one call where the weight keeps them (faster than PyTorch's GEMM for prefills on the
    CPUs measured, docs/cpu_backend.md), else ``F.linear``.
    """
    weight = packed.weight
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if packed.kind in SMALLM and flat.shape[0] > SMALLM_MAX_ROWS:
        out = packed.get().wide(flat, bias)
        return F.linear(x, weight, bias) if out is None else out.reshape(*x.shape[:-1], weight.shape[0])
    if packed.kind == "onednn":
        out = torch.ops.mkldnn._linear_pointwise(flat, packed.get(), bias, "none", [], "")
    else:
        out = packed.get()(flat, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs on a packed copy of its weight (``onednn`` or ``smallm``).

    Made by ``set_backend`` from an existing ``nn.Linear`` (class swap: same parameters, same state
    dict); ``set_backend(..., "eager")`` turns it back.
    """

    _bp_packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self._bp_packed, self.bias)


def packed_kind(model: nn.Module) -> str | None:
    """The packed backend ``model``'s decoder layers run on (``set_backend`` puts every linear on one; read from the
    first layer's q projection), or None off the packed backends. ``model``: a target's base model or a drafter."""
    first = model.layers[0].self_attn.q_proj
    return first._bp_packed.kind if type(first) is PackedLinear else None


def set_backend(module: nn.Module, backend: str) -> nn.Module:
    """Put every ``nn.Linear`` inside ``module`` on ``backend`` (``eager`` or one of ``PACKED``), in place.

    Returns:
        ``module``.
    Raises:
        ValueError: for another name (resolve ``auto`` first with ``resolve_backend``).
    """
    if backend not in ("eager", *PACKED):
        raise ValueError(f"set_backend takes 'eager' or one of {list(PACKED)} (resolve 'auto' first), got {backend!r}")
    if backend in PACKED:
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"  # read by transformers at every attention call
    for sub in module.modules():
        if type(sub) is PackedLinear and (backend == "eager" or sub._bp_packed.kind != backend):
            sub.__class__ = nn.Linear
            del sub._bp_packed
        if backend != "eager" and type(sub) is nn.Linear:
            sub.__class__ = PackedLinear
            sub._bp_packed = _Packed(sub.weight, backend)
    return module


def module_backend(module: nn.Module) -> str:
    """The packed backend of the linears inside ``module`` (the first found), else ``eager``."""
    return next((m._bp_packed.kind for m in module.modules() if type(m) is PackedLinear), "eager")


class LMHead:
    """Logits from final hidden states: ``hidden [..., H] -> [..., N]`` with weight [N, H] (no bias).

    ``eager`` computes ``(weight @ hidden.T).T`` on CPU for up to 64 rows (MKL's small-M GEMM for a
    49,152-row head is ~2.5x slower at 2-16 rows than the transposed product) and ``hidden @ weight.T``
    otherwise; ``onednn`` and ``smallm`` run a packed copy of the weight.

    With ``float32=True`` and a bfloat16/float16 weight the logits are computed and returned in float32 (a bf16
    product rounds logits between 16 and 32 to steps of 0.125, so a 16-row verify and 16 single steps break ties
    differently): on CUDA one GEMM with float32 output (``torch.mm(..., out_dtype=torch.float32)``: each bf16 x bf16
    product is exact in float32, so only the summation order differs from a float32 product), elsewhere (or where
    that GEMM is missing) a float32 copy of the weight made once. A float32 weight is unaffected by the flag.

    Attributes:
        weight: [N, H] the head's rows (the target's LM head, or the drafter's draft-vocabulary rows).
        backend: ``eager`` or one of ``PACKED``.
        float32: float32 logits from a lower-precision weight (see above).
    Raises:
        ValueError: for another backend name.
    """

    def __init__(self, weight: torch.Tensor, backend: str = "eager", float32: bool = False):
        if backend not in ("eager", *PACKED):
            raise ValueError(f"LMHead backend must be 'eager' or one of {list(PACKED)}, got {backend!r}")
        self.weight = weight
        self.backend = backend
        self.float32 = bool(float32) and weight.dtype != torch.float32
        self._packed = _Packed(weight, backend) if backend in PACKED else None
        self._weight32: torch.Tensor | None = None
        self._mm_out_dtype = weight.device.type == "cuda"  # tried first on CUDA; off after one failure

    def _float32_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """[M, H] (any float dtype) -> [M, N] float32 logits of the lower-precision weight."""
        if self._mm_out_dtype and flat.dtype == self.weight.dtype:
            try:
                return torch.mm(flat, self.weight.T, out_dtype=torch.float32)
            except (RuntimeError, TypeError) as err:  # an older torch or GPU without the float32-output GEMM
                log.info("LMHead: no float32-output GEMM here (%s); using a float32 copy of the head", err)
                self._mm_out_dtype = False
        if self._weight32 is None:
            self._weight32 = self.weight.detach().float()
        flat = flat.float()
        if flat.device.type == "cpu" and flat.shape[0] <= 64:
            return (self._weight32 @ flat.T).T
        return flat @ self._weight32.T

    def packed(self):
        """The packed weight (a ``SmallmWeight`` on the smallm backends), or None on ``eager``."""
        return self._packed.get() if self._packed is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes one call streams: the packed form's on smallm, else the weight's own."""
        packed = self.packed()
        return int(getattr(packed, "nbytes", self.weight.numel() * self.weight.element_size()))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return packed_linear(hidden, self._packed, None)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.float32:
            return self._float32_logits(flat).reshape(*hidden.shape[:-1], self.weight.shape[0])
        if flat.device.type == "cpu" and flat.shape[0] <= 64:
            logits = (self.weight @ flat.T).T
        else:
            logits = flat @ self.weight.T
        return logits.reshape(*hidden.shape[:-1], self.weight.shape[0])
