"""The forward path every decoder forward runs on: ``eager``, ``onednn`` or ``smallm``.

On a CPU a decode step multiplies 1-16 token rows (an autoregressive step, a draft, a verify) with
every weight, so it is bound by reading the weights; PyTorch's float32 ``nn.Linear`` goes to MKL, whose
GEMMs for a few rows cost ~2x a 1-row GEMV, and whose results for a row depend on how many rows share
the call. The backends:

- ``eager``: PyTorch's own kernels, unchanged.
- ``onednn``: each weight reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's freezing pass uses) and run with
  ``torch.ops.mkldnn._linear_pointwise``.
- ``smallm``: this project's AVX2 kernel (``kernels/smallm.cpp``, compiled on first use with
  ``torch.utils.cpp_extension``, ~45 s once, cached under ``~/.cache/torch_extensions``): weights
  packed in 16-column panels that are streamed once per call for all rows (up to ``SMALLM_MAX_ROWS``;
  larger inputs, such as a prefill, take PyTorch's GEMM). Every output is one sequential FMA chain over
  K, so a row's result is bit-identical alone or with 15 others: the verify computes exactly what the
  autoregressive step would.

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
import logging
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

BACKENDS = ("auto", "eager", "onednn", "smallm")
PACKED = ("onednn", "smallm")  # backends that keep a packed copy of each weight
SMALLM_MAX_ROWS = 32  # smallm runs inputs of up to this many rows; more go to PyTorch's GEMM
_KERNEL = Path(__file__).with_name("kernels") / "smallm.cpp"


@functools.lru_cache(maxsize=1)
def smallm_kernel():
    """The compiled ``smallm`` extension (built on first use, then loaded from torch's extension cache).

    Raises:
        RuntimeError: when this CPU lacks AVX2/FMA or the build fails (no C++ compiler or ninja); the
            message names the fix (``model.backend=onednn``).
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise RuntimeError(f"the smallm kernel needs an AVX2 CPU (this one reports {capability}); "
                           "use model.backend=onednn or eager")
    from torch.utils.cpp_extension import load

    try:
        # -fopenmp: at::parallel_for runs on torch's OpenMP threads (torch's own libgomp.so.1 is already loaded)
        return load("blockpilot_smallm", [str(_KERNEL)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # compiler, ninja or header problems
        raise RuntimeError(f"could not build the smallm kernel ({err}); install a C++ compiler and ninja, "
                           "or use model.backend=onednn") from err


def smallm_available() -> bool:
    """True when the ``smallm`` kernel builds and loads here (the first call may take ~45 s)."""
    try:
        smallm_kernel()
        return True
    except RuntimeError as err:
        log.warning("%s", err)
        return False


def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN (MKL-DNN) CPU kernels."""
    return bool(torch.backends.mkldnn.is_available())


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``auto`` -> ``smallm``, ``onednn`` or ``eager`` (see the module doc); other names are checked.

    Raises:
        ValueError: for an unknown backend, a packed backend off the CPU or not in float32, or one that
            cannot run on this machine.
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
    if backend == "smallm":
        try:
            smallm_kernel()
        except RuntimeError as err:
            raise ValueError(str(err)) from err
    return backend


class _Packed:
    """A weight [N, K] packed for ``kind`` (``onednn`` | ``smallm``), repacked when the weight changes."""

    __slots__ = ("weight", "kind", "version", "packed")

    def __init__(self, weight: torch.Tensor, kind: str):
        if kind not in PACKED:
            raise ValueError(f"packed weights are for {PACKED}, got {kind!r}")
        self.weight, self.kind = weight, kind
        self.version = -1
        self.packed = None

    def get(self) -> torch.Tensor:
        if self.version != self.weight._version or self.packed is None:
            with torch.no_grad():
                w = self.weight.detach().contiguous()
                self.packed = (torch.ops.mkldnn._reorder_linear_weight(w) if self.kind == "onednn"
                               else smallm_kernel().pack(w))
            self.version = self.weight._version
        return self.packed


def packed_linear(x: torch.Tensor, packed: _Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through a packed weight; x [..., K] -> [..., N] (float32).

    Gradient-tracking calls, and ``smallm`` calls of more than ``SMALLM_MAX_ROWS`` rows, run ``F.linear``.
    """
    weight = packed.weight
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if packed.kind == "smallm" and flat.shape[0] > SMALLM_MAX_ROWS:
        return F.linear(x, weight, bias)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if packed.kind == "onednn":
        out = torch.ops.mkldnn._linear_pointwise(flat, packed.get(), bias, "none", [], "")
    else:
        out = smallm_kernel().linear(flat, packed.get(), weight.shape[0], bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs on a packed copy of its weight (``onednn`` or ``smallm``).

    Made by ``set_backend`` from an existing ``nn.Linear`` (class swap: same parameters, same state
    dict); ``set_backend(..., "eager")`` turns it back.
    """

    _bp_packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self._bp_packed, self.bias)


def set_backend(module: nn.Module, backend: str) -> nn.Module:
    """Put every ``nn.Linear`` inside ``module`` on ``backend`` (``eager``, ``onednn`` or ``smallm``), in place.

    Returns:
        ``module``.
    Raises:
        ValueError: for another name (resolve ``auto`` first with ``resolve_backend``).
    """
    if backend not in ("eager", *PACKED):
        raise ValueError(f"set_backend takes 'eager', 'onednn' or 'smallm' (resolve 'auto' first), got {backend!r}")
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

    Attributes:
        weight: [N, H] the head's rows (the target's LM head, or the drafter's draft-vocabulary rows).
        backend: ``eager``, ``onednn`` or ``smallm``.
    Raises:
        ValueError: for another backend name.
    """

    def __init__(self, weight: torch.Tensor, backend: str = "eager"):
        if backend not in ("eager", *PACKED):
            raise ValueError(f"LMHead backend must be 'eager', 'onednn' or 'smallm', got {backend!r}")
        self.weight = weight
        self.backend = backend
        self._packed = _Packed(weight, backend) if backend in PACKED else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return packed_linear(hidden, self._packed, None)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.device.type == "cpu" and flat.shape[0] <= 64:
            logits = (self.weight @ flat.T).T
        else:
            logits = flat @ self.weight.T
        return logits.reshape(*hidden.shape[:-1], self.weight.shape[0])
