"""The forward path every decoder forward runs on: ``eager`` (PyTorch's own kernels) or ``onednn``.

On a CPU, PyTorch's float32 ``nn.Linear`` goes to MKL, whose GEMMs for a few rows (the 2-16 tokens of a
verify or a draft) repack the weight on every call and cost ~2x a 1-row GEMV; their results also depend
on the number of rows. ``onednn`` reorders each weight once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's freezing pass uses) and runs
``torch.ops.mkldnn._linear_pointwise`` on it. Measured on the 2-core CI CPU (``python -m
pipeline.bench_step``), its results for a row are bit-identical whatever the number of rows, which
MKL's are not below 4 rows.

The backend is set on the loaded modules (``set_backend``), so the target's autoregressive steps and
its verify steps, the prefill and the drafter all take the same path: speedups compare like with like.
The weights are not changed (a packed copy sits beside each one); a weight that changes after packing
(training) is repacked on its next use, and any call that needs gradients runs plain ``F.linear``.

Backends: ``eager``; ``onednn`` (float32 on CPU only); ``auto`` = ``onednn`` for float32 on CPU, else
``eager``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

BACKENDS = ("auto", "eager", "onednn")


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``auto`` -> ``onednn`` for float32 on CPU, else ``eager``; other names are checked and returned.

    Raises:
        ValueError: for an unknown backend, or ``onednn`` off the CPU or not in float32.
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.backend must be one of {list(BACKENDS)}, got {backend!r}")
    on_cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if backend == "auto":
        return "onednn" if on_cpu_fp32 and onednn_available() else "eager"
    if backend == "onednn" and not on_cpu_fp32:
        raise ValueError(f"model.backend=onednn runs float32 on CPU only (got {dtype} on {device}); "
                         "use model.backend=eager or auto")
    if backend == "onednn" and not onednn_available():
        raise ValueError("model.backend=onednn needs a PyTorch build with oneDNN (torch.backends.mkldnn); "
                         "use model.backend=eager")
    return backend


def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN (MKL-DNN) CPU kernels."""
    return bool(torch.backends.mkldnn.is_available())


class _Packed:
    """A weight [N, K] reordered for oneDNN, repacked when the weight's version changes."""

    __slots__ = ("weight", "version", "packed")

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.version = -1
        self.packed = None

    def get(self) -> torch.Tensor:
        if self.version != self.weight._version or self.packed is None:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous())
            self.version = self.weight._version
        return self.packed


def packed_linear(x: torch.Tensor, packed: _Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN's prepacked weight; x [..., K] -> [..., N]."""
    weight = packed.weight
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed.get(), bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs on a oneDNN-prepacked copy of its weight (see module doc).

    Made by ``set_backend`` from an existing ``nn.Linear`` (class swap: same parameters, same state
    dict); ``set_backend(..., "eager")`` turns it back.
    """

    _bp_packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self._bp_packed, self.bias)


def set_backend(module: nn.Module, backend: str) -> nn.Module:
    """Put every ``nn.Linear`` inside ``module`` on ``backend`` (``eager`` or ``onednn``), in place.

    Returns:
        ``module``.
    Raises:
        ValueError: for another backend name (resolve ``auto`` first with ``resolve_backend``).
    """
    if backend not in ("eager", "onednn"):
        raise ValueError(f"set_backend takes 'eager' or 'onednn' (resolve 'auto' first), got {backend!r}")
    for sub in module.modules():
        if backend == "onednn" and type(sub) is nn.Linear:
            sub.__class__ = OneDNNLinear
            sub._bp_packed = _Packed(sub.weight)
        elif backend == "eager" and type(sub) is OneDNNLinear:
            sub.__class__ = nn.Linear
            del sub._bp_packed
    return module


def module_backend(module: nn.Module) -> str:
    """``onednn`` when any linear inside ``module`` runs on oneDNN, else ``eager``."""
    return "onednn" if any(type(m) is OneDNNLinear for m in module.modules()) else "eager"


class LMHead:
    """Logits from final hidden states: ``hidden [..., H] -> [..., N]`` with weight [N, H] (no bias).

    ``eager`` computes ``(weight @ hidden.T).T`` on CPU for up to 64 rows (MKL's small-M GEMM for a
    49,152-row head is ~2.5x slower at 2-16 rows than the transposed product) and ``hidden @ weight.T``
    otherwise; ``onednn`` runs the prepacked weight.

    Attributes:
        weight: [N, H] the head's rows (the target's LM head, or the drafter's draft-vocabulary rows).
        backend: ``eager`` or ``onednn``.
    """

    def __init__(self, weight: torch.Tensor, backend: str = "eager"):
        if backend not in ("eager", "onednn"):
            raise ValueError(f"LMHead backend must be 'eager' or 'onednn', got {backend!r}")
        self.weight = weight
        self.backend = backend
        self._packed = _Packed(weight) if backend == "onednn" else None

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return packed_linear(hidden, self._packed, None)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.device.type == "cpu" and flat.shape[0] <= 64:
            logits = (self.weight @ flat.T).T
        else:
            logits = flat @ self.weight.T
        return logits.reshape(*hidden.shape[:-1], self.weight.shape[0])
