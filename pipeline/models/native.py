"""The native stacks: a whole target forward (``Stack``) and a whole DFlash draft forward (``DraftStack``) as one call
of the smallm kernel (``kernels/smallm.cpp``), and what they are built from: each weight in the packed form the kernel
streams (``_spec``; ``vnni_layout`` for ``model.precision=int8``), each pre-norm layer's products and norms
(``_layer_specs``). ``pipeline.models.forward`` runs them where the model and backend allow, transformers' own
forward elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.backend import _FORMAT_CODE, _GROUP, EXACT_FORMATS, SmallmWeight, _panels, pack_smallm
from pipeline.models.cache import reserve_rows
from pipeline.models.kernel import smallm_kernel

PRECISIONS = ("exact", "int8")  # what the target's native stack runs
PRECISION_SETTINGS = ("auto", *PRECISIONS)  # model.precision
DRAFT_PRECISIONS = ("auto", "exact", "bf16", "int8")  # model.draft_precision
_Q4_INT8 = 4  # kernels/smallm.cpp's kQ4Int8: q4 weights in the VNNI layout times int8 activations
_BF16_DOT = 5  # kernels/smallm.cpp's kBF16Dot: bf16 weights in pairs times bf16 activations (VDPBF16PS)
_Q8_INT8 = 6  # kernels/smallm.cpp's kQ8Int8: q8 weights in the VNNI layout times int8 activations (VPDPBUSD)
_ALL_ROWS = 1 << 30  # a spec's exact_rows where no float32 panels are kept beside it


def bf16_pairs(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K even) -> ``linear_bf16``'s layout [ceil(N / 16), K / 2, 32] int16: panel p's pair u holds, at
    2c + b, column 16p + c's weight at k = 2u + b rounded to bf16 (nearest even; a bf16-stored weight is unchanged),
    zero past N."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"bf16 products need an even input width, got {k}")
    p = (n + 15) // 16
    padded = torch.zeros(p * 16, k, dtype=torch.bfloat16)
    padded[:n] = w.detach().to(torch.bfloat16)
    return padded.view(torch.int16).view(p, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(p, k // 2, 32).contiguous()


def bf16_dot_available() -> bool:
    """Whether this CPU runs the drafter's bf16 products: the kernel's AVX-512 build and AVX-512 BF16."""
    from pipeline.models.kernel import cpu_flags, cpu_isa

    return cpu_isa() == "avx512" and "avx512_bf16" in cpu_flags()


def int8_dot_available() -> bool:
    """Whether this CPU runs int8 products (``model.precision=int8``, ``model.draft_precision=int8``): the kernel's
    AVX-512 build and AVX-512 VNNI."""
    from pipeline.models.kernel import cpu_flags, cpu_isa

    return cpu_isa() == "avx512" and "avx512_vnni" in cpu_flags()


def resolve_draft_precision(setting: str | None) -> str:
    """``model.draft_precision`` -> ``exact``, ``bf16`` or ``int8``: ``auto`` (None) is ``int8`` where the CPU has
    AVX-512 VNNI (``int8_dot_available``), else ``bf16`` where it has AVX-512 BF16 (``bf16_dot_available``), else
    ``exact``. The drafter only proposes tokens the target verifies, so its precision changes how many drafts are
    accepted, never the output (int8 drafts were accepted as often as bf16 ones: docs/results.md, 2026-12-05).

    Raises:
        ValueError: for another name, ``bf16`` on a CPU without AVX-512 BF16 or ``int8`` on one without AVX-512 VNNI
            (names the fix).
    """
    setting = "auto" if setting is None else str(setting)
    if setting not in DRAFT_PRECISIONS:
        raise ValueError(f"model.draft_precision must be one of {list(DRAFT_PRECISIONS)}, got {setting!r}")
    if setting == "auto":
        return "int8" if int8_dot_available() else "bf16" if bf16_dot_available() else "exact"
    if setting == "bf16" and not bf16_dot_available():
        raise ValueError("model.draft_precision=bf16 needs a CPU with AVX-512 BF16 (and the kernel's avx512 build); "
                         "use model.draft_precision=auto or exact")
    if setting == "int8" and not int8_dot_available():
        raise ValueError("model.draft_precision=int8 needs a CPU with AVX-512 VNNI (and the kernel's avx512 build); "
                         "use model.draft_precision=auto or exact")
    return setting


def _bf16_spec(weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
    """A weight as the native stack takes it for the drafter's bf16 products (``kBF16Dot``)."""
    empty = torch.empty(0)
    return (_BF16_DOT, bf16_pairs(weight), empty, empty, empty, weight.shape[0], _ALL_ROWS,
            None if bias is None else bias.detach().float())


def q8_quantize(w: torch.Tensor) -> SmallmWeight:
    """``w`` [N, K] (K a multiple of 32) rounded to q8 by GGUF Q8_0's rule (ggml's ``quantize_row_q8_0``), per row and
    group of 32: ``q = round(w / d)`` with ``d = absmax / 127``, stored as the float16 of d: a lossy q8 ``SmallmWeight``
    (the drafter's int8 products; its weights are not of that form)."""
    n, k = w.shape
    if k % _GROUP:
        raise ValueError(f"q8 needs an input width that is a multiple of {_GROUP}, got {k}")
    blocks = w.detach().float().view(n, k // _GROUP, _GROUP)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1.0)), 0.0).clamp_(-127, 127)
    return SmallmWeight("q8", _panels(q.view(n, k).to(torch.int8)), _panels(d.half().float().view(n, -1)),
                        torch.empty(0), n)


class Bf16Head:
    """The drafter's head on bf16 products: ``hidden [..., H] -> [..., N]`` float32 logits of ``weight`` [N, H] (its
    rows rounded to bf16 once, the activations per call), each row's logits a fixed computation of its own row."""

    def __init__(self, weight: torch.Tensor):
        self.n = weight.shape[0]
        with torch.no_grad():
            self.pairs = bf16_pairs(weight.float())

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).float().contiguous()
        return smallm_kernel().linear_bf16(flat, self.pairs, self.n, None).reshape(*hidden.shape[:-1], self.n)


class Int8Head:
    """An LM head on int8 products: q8 rows (GGUF Q8_0, ``w = d q``) times the final states quantized to int8 per row
    and group of 32, as the q4 products of ``model.precision=int8`` quantize theirs (``linear_q8_int8``, AVX-512 VNNI);
    each row's logits a fixed computation of its own row. The target's head on ``model.precision=int8`` (its own q8
    rows), the drafter's on ``model.draft_precision=int8`` (``quantized``: its rows rounded to q8).

    Raises:
        ValueError: for a head whose packed weight is not q8.
    """

    def __init__(self, packed):
        if packed is None or packed.fmt != "q8":
            raise ValueError("an int8 LM head needs the head's q8 form (GGUF Q8_0); this one is "
                             f"{getattr(packed, 'fmt', 'not packed')}")
        self.n = packed.n
        self.vnni = q8_vnni_layout(packed.q)
        self.d = q8_scales(packed.d)

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> "Int8Head":
        """The head of ``weight`` [N, H] rounded to q8 (``q8_quantize``)."""
        return cls(q8_quantize(weight))

    @property
    def nbytes(self) -> int:
        """Bytes one call streams: the int8 rows and their scales."""
        return sum(t.numel() * t.element_size() for t in (self.vnni, self.d))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).float().contiguous()
        return smallm_kernel().linear_q8_int8(flat, self.vnni, self.d, self.n).reshape(*hidden.shape[:-1], self.n)


def q8_vnni_layout(q: torch.Tensor) -> torch.Tensor:
    """q8 panels [P, K, 16] int8 -> the VNNI layout [P, K / 32, 8, 64] uint8 of ``linear_q8_int8``: chunk u's byte
    4c + b is column c's q + 128 at k = 32g + 4u + b (VPDPBUSD's unsigned operand)."""
    P, K, _ = q.shape
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)
    return shifted.view(P, K // 32, 8, 4, 16).permute(0, 1, 2, 4, 3).contiguous().view(P, K // 32, 8, 64)


def q8_scales(d: torch.Tensor) -> torch.Tensor:
    """q8 scales [P, K / 32, 16] float32 -> float16 (``linear_q8_int8``'s), the same values at half the bytes.

    Raises:
        ValueError: when some scale is not a float16 (neither a GGUF Q8_0 block's nor ``q8_quantize``'s; ``pack_smallm``
            finds q8 blocks only with float16 scales, so no packed head is refused).
    """
    half = d.half()
    if not torch.equal(half.float(), d):
        raise ValueError("q8 scales that float16 does not hold exactly (neither a GGUF Q8_0 block's nor q8_quantize's)")
    return half.contiguous()


def vnni_layout(q: torch.Tensor) -> torch.Tensor:
    """q4 panels [P, K, 8] (byte j: column j's nibble low, column j + 8's high) -> the VNNI layout [P, K / 32, 4, 64]
    of ``linear_q4_int8``: chunk u's byte 4c + b holds k = 4u + b of column c (low nibble) and k = 4(u + 4) + b (high)."""
    P, K, _ = q.shape
    nibbles = torch.cat([q & 15, q >> 4], dim=-1)  # [P, K, 16]: column c's value at k
    quads = nibbles.view(P, K // 32, 8, 4, 16).permute(0, 1, 2, 4, 3)  # [P, G, quad, c, b]
    return (quads[:, :, :4] | (quads[:, :, 4:] << 4)).contiguous().view(P, K // 32, 4, 64)


def q4_scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q4 scales and offsets [P, K / 32, 16] float32 -> [P, K / 32, 32] float16 (each group's 16 d, then its 16 m):
    ``linear_q4_int8``'s scales, the same values at half the bytes (a GGUF Q4_1 block stores both as float16).

    Raises:
        ValueError: when some value is not a float16 (not a GGUF block's: ``pack_smallm`` packs no such q4).
    """
    both = torch.cat([d, m], dim=-1)
    half = both.half()
    if not torch.equal(half.float(), both):
        raise ValueError("q4 scales or offsets that float16 does not hold exactly (not a GGUF Q4_1 block's)")
    return half.contiguous()


def _spec(weight: SmallmWeight, bias: torch.Tensor | None = None, precision: str = "exact") -> tuple:
    """A packed weight as the native stack takes it: (format code, panels, scales, offsets, float32 panels, N,
    exact_rows, bias). With ``precision="int8"`` a q4 weight goes in the VNNI layout (int8 activations), its scales and
    offsets in one float16 array (``q4_scales``; no offsets entry)."""
    empty = torch.empty(0)
    bias = None if bias is None else bias.detach().float()
    if precision == "int8" and weight.fmt == "q4":
        return (_Q4_INT8, vnni_layout(weight.q), q4_scales(weight.d, weight.m), empty, empty, weight.n,
                weight.exact_rows, bias)
    code = 0 if weight.fmt == "f32" else _FORMAT_CODE[weight.fmt]
    return (code, weight.q, weight.d, weight.m, weight.f32 if weight.f32 is not None else empty, weight.n,
            weight.exact_rows, bias)


def _q8_int8_spec(weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
    """A weight as the native stack takes it for the drafter's int8 products (``kQ8Int8``): rounded to q8
    (``q8_quantize``), in the VNNI layout with its float16 scales."""
    packed = q8_quantize(weight)
    return (_Q8_INT8, q8_vnni_layout(packed.q), q8_scales(packed.d), torch.empty(0), torch.empty(0), packed.n, _ALL_ROWS,
            None if bias is None else bias.detach().float())


_DRAFT_SPECS = {"bf16": _bf16_spec, "int8": _q8_int8_spec}  # the drafter's products per model.draft_precision


def _layer_specs(layer: nn.Module, formats, precision: str = "exact", draft: bool = False) -> tuple:
    """A pre-norm layer (a target's decoder layer or a DFlash draft layer) as ``Stack.add_layer`` / ``DraftStack.add_layer``
    take it: the fused q/k/v (with its biases) and gate/up products packed once, o and down as their ``PackedLinear``
    already holds them, the norms' weights (q/k norms where the family has them, else None). A draft layer
    (``draft``) on ``bf16`` or ``int8`` takes every product in that form (``_DRAFT_SPECS``)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    biases = [lin.bias for lin in qkv]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else torch.zeros(lin.weight.shape[0]) for b, lin in zip(biases, qkv)])
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
             None if q_norm is None else q_norm.weight.detach(), None if k_norm is None else k_norm.weight.detach())
    if draft and precision in _DRAFT_SPECS:  # the drafter's reduced-precision products (model.draft_precision)
        spec = _DRAFT_SPECS[precision]
        return (spec(torch.cat([lin.weight.detach() for lin in qkv]), bias), spec(attn.o_proj.weight, attn.o_proj.bias),
                spec(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])),
                spec(mlp.down_proj.weight, mlp.down_proj.bias), *norms)
    return (_spec(pack_smallm(torch.cat([lin.weight.detach() for lin in qkv]), formats), bias, precision),
            _spec(attn.o_proj._bp_packed.get(), attn.o_proj.bias, precision),
            _spec(pack_smallm(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]), formats), None,
                  precision),
            _spec(mlp.down_proj._bp_packed.get(), mlp.down_proj.bias, precision), *norms)


def check_precision(precision: str) -> None:
    """Raise ``ValueError`` unless ``precision`` (``model.precision``) can run here: ``auto`` and ``exact`` anywhere;
    ``int8`` needs the kernel's AVX-512 build on a CPU with AVX-512 VNNI."""
    from pipeline.models.kernel import cpu_isa

    if precision not in PRECISION_SETTINGS:
        raise ValueError(f"model.precision must be one of {list(PRECISION_SETTINGS)}, got {precision!r}")
    if precision == "int8" and not int8_dot_available():
        raise ValueError("model.precision=int8 needs a CPU with AVX-512 VNNI (and the kernel's avx512 build); this one "
                         f"runs {cpu_isa()} without it: use model.precision=auto or exact")


KV_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
"""What ``model.kv_cache_dtype`` may name besides ``auto``: the element of the target's KV cache on the native stack."""


def check_kv_dtype(setting: str) -> None:
    """Raise ``ValueError`` unless ``setting`` (``model.kv_cache_dtype``) is ``auto`` or one of ``KV_DTYPES``."""
    if setting not in ("auto", *KV_DTYPES):
        raise ValueError(f"model.kv_cache_dtype must be one of {['auto', *KV_DTYPES]}, got {setting!r}")


def resolve_kv_dtype(setting: str | None, precision: str, native: bool) -> torch.dtype:
    """``model.kv_cache_dtype`` -> the target's KV cache element: ``auto`` (None) is bfloat16 where the target runs on
    the native stack with int8 products (the fast path: a step reads every request's cache, half the bytes), else
    float32 (``exact`` stays the reference, float32 throughout); ``float32`` and ``bf16`` as named. The kernel widens
    bfloat16 keys and values exactly to float32 before its float32 attention, and rounds new ones to nearest even, so a
    row's result stays the same bits alone or batched, and speculation stays lossless against its own ``ar``.

    Raises:
        ValueError: for an unknown name (``check_kv_dtype``), or ``bf16`` where the target is not on the native stack.
    """
    setting = "auto" if setting is None else str(setting)
    check_kv_dtype(setting)
    if setting == "auto":
        return torch.bfloat16 if native and precision == "int8" else torch.float32
    if setting == "bf16" and not native:
        raise ValueError("model.kv_cache_dtype=bf16 needs the target on the native stack (transformers' attention reads "
                         "float32 caches here): use model.kv_cache_dtype=auto or float32")
    return KV_DTYPES[setting]


def resolve_precision(setting: str | None, native: bool) -> str:
    """``model.precision`` -> what the target's products run: ``auto`` (None) is ``int8`` where the target runs on the
    native stack (``native``) and the CPU has AVX-512 VNNI (``int8_dot_available``), else ``exact``; ``exact`` and
    ``int8`` unchanged. int8 is not exact against transformers' float32 forward, but every method runs on the same
    products, so speculation stays lossless against its own ``ar`` (docs/cpu_backend.md).

    Raises:
        ValueError: as ``check_precision``.
    """
    setting = "auto" if setting is None else str(setting)
    check_precision(setting)
    if setting == "auto":
        return "int8" if native and int8_dot_available() else "exact"
    return setting


class NativeStack:
    """The target's decoder layers and final norm as ONE call of the smallm kernel per forward (``Stack`` in
    ``kernels/smallm.cpp``): the norms, the fused q/k/v and gate/up products, q/k norms, rotary, the cache append, the
    batch-invariant attention, SiLU x up and the residuals run in C++; Python hands over the embedded rows, the rotary
    tables and the caches' buffers once. Any number of rows of any number of requests; a row's result is the same
    bits alone or beside others (and the same on AVX2 and AVX-512 builds).

    Built from ``base`` on the smallm backend ``kind``; rebuilt when any weight changes (``weight_version``). Its caches
    hold ``kv_dtype`` (float32, or bfloat16: ``resolve_kv_dtype``).
    """

    def __init__(self, base: nn.Module, kind: str, precision: str = "exact", kv_dtype: torch.dtype = torch.float32):
        self.base, self.kind, self.precision, self.kv_dtype = base, kind, precision, kv_dtype
        self.layers = base.layers[: base.config.num_hidden_layers]
        attn = self.layers[0].self_attn
        self.kv_heads = base.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self._weights = [w for layer in self.layers for w in self._layer_weights(layer)] + [base.norm.weight]
        self._counted = [w for w in self._weights if not w.is_inference()]  # inference tensors have no counter
        self._stack = None

    @staticmethod
    def _layer_weights(layer: nn.Module) -> list[torch.Tensor]:
        attn, mlp = layer.self_attn, layer.mlp
        return [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight, mlp.gate_proj.weight,
                mlp.up_proj.weight, mlp.down_proj.weight]

    def _build(self):
        base, formats = self.base, () if self.kind == "smallm_f32" else EXACT_FORMATS
        config = base.config
        first = self.layers[0]
        stack = smallm_kernel().Stack(config.hidden_size, first.self_attn.config.num_attention_heads, self.kv_heads,
                                      self.head_dim, first.mlp.gate_proj.weight.shape[0],
                                      float(base.norm.variance_epsilon), float(self.scale),
                                      base.norm.weight.detach().float())
        with torch.no_grad():
            for layer in self.layers:
                stack.add_layer(*_layer_specs(layer, formats, self.precision))
        stack.watch(self._counted)
        return stack

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches, rows, taps, parents=None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder layers over ``h`` [R, H] (the embedded rows; request i's ``rows[i]`` consecutive, appended to
        ``caches[i]``) with rotary tables ``cos``/``sin`` [R, D]. ``parents``: None (causal rows) or, for a draft tree,
        each row's parent among its request's rows (-1: the first row), ``pipeline.decoding.trees``: a row attends to the
        cached context, its ancestors and itself.

        Returns:
            (final normed states [R, H], the hidden states at ``taps`` (transformers' ``hidden_states`` indices) side
            by side [R, len(taps) * H]), or None when a cache cannot take the native path (nothing was changed).
        """
        if self._stack is None or self._stack.changed():  # repacked when a weight changed in place (training)
            self._stack = self._build()
        reserved = reserve_rows(caches, rows, len(self.layers), (self.kv_heads, self.head_dim, self.kv_dtype))
        if reserved is None:
            return None
        keys, values, lengths = reserved
        out, tapped = self._stack.forward(h, cos, sin, keys, values, list(rows), lengths, list(taps),
                                          [] if parents is None else [int(p) for p in parents])
        return out, tapped


def build_draft_stack(drafter: nn.Module, kind: str, precision: str = "exact"):
    """The ``DraftStack`` of a DFlash drafter on smallm backend ``kind`` (its fc, norms and layers packed once);
    ``precision`` ``bf16`` / ``int8``: every product on bf16 weights and activations, or on q8 weights and int8
    activations (``resolve_draft_precision``)."""
    d = drafter
    formats = () if kind == "smallm_f32" else EXACT_FORMATS
    attn0, mlp0 = d.layers[0].self_attn, d.layers[0].mlp
    with torch.no_grad():
        fc = (_DRAFT_SPECS[precision](d.fc.weight) if precision in _DRAFT_SPECS
              else _spec(pack_smallm(d.fc.weight.detach(), formats)))
        stack = smallm_kernel().DraftStack(
            d.config.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, mlp0.gate_proj.weight.shape[0],
            float(d.norm.variance_epsilon), float(attn0.head_dim ** -0.5), fc,
            d.fc.weight.shape[1], d.hidden_norm.weight.detach(), d.norm.weight.detach())
        for layer in d.layers:
            stack.add_layer(*_layer_specs(layer, formats, precision, draft=True))
    return stack
