"""Free the float32 weights a decoder's native forward never reads (``release_unused_weights``), for a process whose
forward stays on the native path for its whole life (the server, ``pipeline.serve``).

On the native path (``model.backend=smallm`` in float32, ``model.fast_forward`` on: ``pipeline.models.native``) every
target forward is one call of the kernel's ``Stack`` and every draft forward one call of its ``DraftStack``; each holds
its own packed copies of the weights (q4 / q8 panels, the int8 VNNI layouts, bf16 pairs), and the LM heads on int8 or
bf16 products hold theirs (``Int8Head``, ``Bf16Head``). The float32 parameters they were packed from are then read by
nothing that runs: transformers' decoder layers (for the embedded SmolLM2, pages of the dequantized checkpoint's file
mapping, resident once packed), the drafter's layers and its float32 head rows, and the packed copies of transformers'
forward on the smallm backend. ``release_unused_weights`` builds the native stacks, then puts a ``ReleasedWeight`` in the place of each
such parameter: the same shape and dtype, no storage; any computation with it raises ``ReleasedWeightError`` naming the
weight (transformers' own forward on any backend, a state dict, a replay).

The embedding is looked up by every forward. Where it is tied to the LM head and the head's q8 packed rows expand to
every one of its float32 values bit for bit (SmolLM2: GGUF Q8_0 rows), lookups read those rows instead
(``PackedRowsEmbedding``) and the float32 table goes too; otherwise it stays.

Kept: norms, biases and buffers (small; the stacks hold their own references), the drafter's whole float32 model with
``keep_drafter`` (a recording server replays drafts on the drafter's own forward, ``pipeline.labeling.replay``), and the
drafter's head rows where its head runs exact products. Kept tensors that live in a file mapping are copied out of it,
so that the mapping (the whole checkpoint) goes once the released tensors are gone.

Tests and the label stage compare against transformers' own forward: they never release (nothing does by default).
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


class ReleasedWeightError(RuntimeError):
    """A computation that needs a weight ``release_unused_weights`` freed."""


class ReleasedWeight(torch.Tensor):
    """The place of a released weight: its shape, dtype and device, no storage. Reading its metadata works (``shape``,
    ``dtype``, ``device``); any operation on its values raises ``ReleasedWeightError`` naming it."""

    released_name: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str):
        out = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                  requires_grad=False)
        out.released_name = name
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.released_name for a in (*args, *(kwargs or {}).values()) if isinstance(a, ReleasedWeight)]
        if not names:  # a list argument (torch.cat)
            names = [t.released_name for a in args if isinstance(a, (list, tuple)) for t in a
                     if isinstance(t, ReleasedWeight)]
        raise ReleasedWeightError(
            f"{', '.join(names) or 'a weight'} was released (pipeline.models.release.release_unused_weights: the "
            f"native forward of this decoder never reads its float32 values, so they were freed), and {func} needs "
            "it: transformers' own forward (on any backend), a replay or a state dict need a "
            "decoder that was not released (build_decoder)")

    def __repr__(self):
        return f"ReleasedWeight({self.released_name}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _nbytes(t) -> int:
    return t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) and not isinstance(t, ReleasedWeight) else 0


def unreleasable(decoder) -> str | None:
    """Why ``decoder``'s weights cannot be released (None when they can): its target must run on the native stack,
    every forward of any length, on preallocated caches (``pipeline.models.forward.forward_for`` chose it)."""
    if decoder.native is None or decoder.native.stack() is None:
        return ("the target does not run on the native stack (model.backend=smallm or auto in float32, "
                "model.fast_forward on, model.kv_cache preallocated or auto, a supported target)")
    return None


def _file_mapped():
    """The sorted (start, end) address ranges of this process's file mappings (Linux; empty elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[4] != "0" and not parts[5].startswith("["):
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return sorted(ranges)


def _own(tensors, ranges) -> int:
    """Copy each tensor of ``tensors`` that lives in one of the file mappings ``ranges`` into memory of its own (in
    place: every holder of the tensor object sees the copy). Returns the bytes copied."""
    starts = [lo for lo, _ in ranges]
    copied = 0
    for t in tensors:
        if isinstance(t, ReleasedWeight) or t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < ranges[i][1]:
            with torch.no_grad():
                t.data = t.data.clone()
            copied += _nbytes(t)
    return copied


def _release_linears(modules, prefix: str, report: dict, part: str) -> None:
    """Put a ``ReleasedWeight`` in the place of every ``nn.Linear`` weight inside ``modules`` (named ``prefix`` + its
    module path); a packed linear's packed copy goes with it. Adds the bytes to ``report[part]`` and
    ``report["packed_copies"]`` (on exact products the native stack may share some of them)."""
    from pipeline.models.backend import PackedLinear, _Packed

    for name, module in modules.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module.weight, ReleasedWeight):
            continue
        old = module.weight
        module._parameters["weight"] = ReleasedWeight(old, f"{prefix}{name}.weight")
        report[part] = report.get(part, 0) + _nbytes(old)
        if type(module) is PackedLinear:  # a fresh packing of the released weight: its first use raises
            packed = module._bp_packed.packed
            report["packed_copies"] = report.get("packed_copies", 0) + sum(
                _nbytes(getattr(packed, a, None)) for a in ("q", "d", "m", "f32"))
            module._bp_packed = _Packed(module.weight, module._bp_packed.kind)
        with torch.no_grad():
            old.data = torch.empty(0, dtype=old.dtype, device=old.device)  # whoever else holds it holds nothing


def _rebuild(owner, freeze: bool) -> None:
    """Build the native stack of ``owner`` (a ``NativeStack`` or a ``NativeDraft``) again from the weights as they are now
    (kept ones copied out of file mappings); with ``freeze``, stop it from checking its weights for changes (it would
    rebuild from released ones)."""
    owner._stack = None
    if freeze:
        owner._counted = []
        if hasattr(owner, "_weights"):
            owner._weights = []
    if hasattr(owner, "_build"):  # NativeStack: otherwise built on its first call
        owner._stack = owner._build()
    else:
        owner.native_stack()


class PackedRowsEmbedding(nn.Embedding):
    """An embedding whose rows are read from the LM head's q8 packed form (a tied embedding: the same float32 values,
    ``d * q`` per group of 32, checked bit for bit when made) instead of a float32 table: ``_bp_q`` the head's int8
    rows (``Int8Head``'s VNNI layout [P, K / 32, 8, 16, 4] of q + 128, or ``SmallmWeight`` panels [P, K, 16]), ``_bp_d``
    their scales [P, K / 32, 16] (float16 or float32). Made by ``release_unused_weights`` (a class swap; its ``weight``: a ``ReleasedWeight``)."""

    _bp_q: torch.Tensor
    _bp_d: torch.Tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _packed_rows(self._bp_q, self._bp_d, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)


def _packed_rows(q: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [n] of a q8 packed weight (``q``: VNNI [P, G, 8, 16, 4] uint8 of q + 128, or panels [P, K, 16]
    int8, contiguous; ``d`` [P, G, 16]) -> [n, K] float32, each value ``d * q`` as the kernel expands it (one
    ``index_select`` each)."""
    groups = d.shape[1]
    p, c = ids // 16, ids % 16
    if q.dim() == 5:  # row 16 p + c at k = 32 g + 4 u + b: q[p, g, u, c, b]
        inner = (torch.arange(groups)[:, None, None] * q.stride(1) + torch.arange(8)[:, None] * q.stride(2)
                 + torch.arange(4)).reshape(-1)
        at = p * q.stride(0) + c * q.stride(3)
    else:  # q[p, k, c]
        inner, at = torch.arange(groups * 32) * q.stride(1), p * q.stride(0) + c
    values = q.reshape(-1).index_select(0, (at[:, None] + inner).reshape(-1)).view(-1, groups, 32)
    at_d = (p * d.stride(0) + c)[:, None] + torch.arange(groups) * d.stride(1)
    scales = d.reshape(-1).index_select(0, at_d.reshape(-1)).float()
    return (scales.view(-1, groups, 1) * _signed(values)).view(-1, groups * 32)


def _signed(q: torch.Tensor) -> torch.Tensor:
    """q8 values as float32: int8 panels as they are, the VNNI layout's uint8 q + 128 shifted back."""
    return (q.to(torch.int16) - 128).float() if q.dtype == torch.uint8 else q.float()


def _embedding_rows(decoder) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, d) of the target head's q8 packed form where the embedding is tied to the head and every one of its rows
    expands to the embedding's float32 values bit for bit, else None (the float32 table stays)."""
    from pipeline.models.backend import LMHead
    from pipeline.models.native import Int8Head

    embed = decoder.embed
    if type(embed) is not nn.Embedding or embed.weight is not decoder.lm_head or embed.max_norm is not None:
        return None
    product = getattr(decoder.head, "_product", None)
    if isinstance(product, Int8Head):
        P, G = product.vnni.shape[:2]
        q, d = product.vnni.view(P, G, 8, 16, 4), product.d
    elif isinstance(product, LMHead) and getattr(product.packed(), "fmt", None) == "q8":
        q, d = product.packed().q, product.packed().d
    else:
        return None
    weight, groups = embed.weight.detach(), d.shape[1]
    with torch.inference_mode():
        for a in range(0, q.shape[0], 256):  # 4096 rows at a time, in panel order
            part = q[a: a + 256]
            part = part.permute(0, 3, 1, 2, 4) if q.dim() == 5 else part.permute(0, 2, 1)
            rows = (d[a: a + 256].float().permute(0, 2, 1).reshape(-1, groups, 1) * _signed(part.reshape(-1, groups, 32)))
            want = weight[16 * a: 16 * (a + 256)]
            if not torch.equal(rows.reshape(-1, groups * 32)[: len(want)].view(torch.int32), want.view(torch.int32)):
                log.warning("the LM head's q8 rows do not expand to the embedding bit for bit: its float32 table stays")
                return None
    return q, d


def _release_embedding(decoder, rows, report: dict) -> None:
    """The tied embedding / LM head weight released: lookups read the head's packed rows (``PackedRowsEmbedding``), the
    heads on exact products keep their packed form, and every holder of the float32 weight gets the
    ``ReleasedWeight``."""
    from pipeline.models.backend import LMHead, weight_version

    old = decoder.lm_head
    released = ReleasedWeight(old, "model.embed_tokens.weight (tied to lm_head.weight)")
    embed, model = decoder.embed, decoder.model
    embed.__class__ = PackedRowsEmbedding
    embed._bp_q, embed._bp_d = rows
    for module in (embed, model.get_output_embeddings()):
        module._parameters["weight"] = released
    decoder.lm_head = decoder.head.weight = released
    if decoder.draft_head is old:  # a drafter that scores the whole vocabulary
        decoder.draft_head = released
    for product in (decoder.head._product, decoder.drafter_head):
        if isinstance(product, LMHead) and product.weight is old:  # exact products: packed now, never again
            product.packed()
            product.weight = product._packed.weight = released
            product._packed.version = weight_version(released)
    model.__dict__.pop("_blockpilot_logit_head", None)  # made again from the module (and its check then raises)
    report["embedding"] = _nbytes(old)
    with torch.no_grad():
        old.data = torch.empty(0, dtype=old.dtype, device=old.device)


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc ``malloc_trim``; nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


MMAP_THRESHOLD = 256 * 1024
"""Allocations of at least this many bytes get mappings of their own (``pin_mmap_threshold``)."""


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``nbytes`` (``mallopt(M_MMAP_THRESHOLD)``, and its trim threshold at twice that):
    every allocation that large (a KV buffer, a packed weight, a step's logits) gets a mapping of its own, handed back
    to the system when freed. Left alone, glibc raises the threshold to the size of each mapped block freed (up to 32 MiB: the float32 weights
    ``release_unused_weights`` frees), and later KV buffers land in the heap, where freed ones stay resident between
    live ones: the server's peak at 16 requests, 2026-12-06, 977-993 MB unpinned against 920-939 MB pinned. Where there
    is no glibc, nothing changes. Returns whether it was set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        # M_TRIM_THRESHOLD too (the raise above set it to twice the block): a heap top larger than that goes back, so
        # a large request finds no top to be carved from and is mapped; then the top is trimmed now
        pinned = bool(libc.mallopt(-3, int(nbytes))) and bool(libc.mallopt(-1, 2 * int(nbytes)))  # MMAP, TRIM
        libc.malloc_trim(0)
        return pinned
    except (OSError, AttributeError):
        return False


def release_unused_weights(decoder, keep_drafter: bool = False) -> dict[str, int]:
    """Free the float32 weights and packed copies ``decoder``'s native forward never reads (see the module doc), in
    place, for the life of the process; outputs are unchanged (the stacks are built from the same weights).

    Args:
        keep_drafter: keep the drafter's float32 weights and head rows (a replay of its drafts needs them:
            ``serve.record``).
    Returns:
        bytes per part: ``target_layers`` and ``drafter_layers`` (float32 weights), ``packed_copies`` (the packed
        linears of transformers' forward; on exact products the native stack shares some), ``embedding`` (the tied float32 table,
        where the head's q8 rows give it), ``draft_head`` (the drafter's float32 head rows), ``draft_lm_head`` (the
        drafter checkpoint's head rows, read only by ``save_pretrained``), ``copied_out`` (kept tensors copied out of
        file mappings: not freed). Empty when already released.
    Raises:
        ValueError: where the target does not run on the native stack (``unreleasable``).
    """
    from pipeline.models.backend import LMHead

    if getattr(decoder, "released_weights", None) is not None:
        return {}
    reason = unreleasable(decoder)
    if reason is not None:
        raise ValueError(f"release_unused_weights: {reason}; its forward reads the float32 weights")
    drafter, native_draft = decoder.drafter, decoder.native_draft
    native_draft = native_draft if native_draft is not None and native_draft.native_stack() is not None else None
    release_drafter = drafter is not None and native_draft is not None and not keep_drafter  # else its own forward may run
    released = [decoder.base.layers] + ([drafter] if release_drafter else [])
    ids = {id(m.weight) for part in released for m in part.modules() if isinstance(m, nn.Linear)}
    # a recording server's replay reads a whole-vocabulary drafter's head rows: the float32 table itself
    rows = None if keep_drafter and decoder.draft_head is decoder.lm_head else _embedding_rows(decoder)
    if rows is not None:
        ids.add(id(decoder.lm_head))
    kept = [t for model in (decoder.model, drafter) if model is not None
            for t in (*model.parameters(), *model.buffers()) if id(t) not in ids]
    report = {"copied_out": _own(kept, _file_mapped())}
    _rebuild(decoder.native.stack(), freeze=True)  # its norms: the copies, not the mapping
    _release_linears(decoder.base.layers, "model.layers.", report, "target_layers")
    if native_draft is not None:
        _rebuild(native_draft, freeze=release_drafter)
    if release_drafter:
        _release_linears(drafter, "drafter.", report, "drafter_layers")
        if decoder.draft_head is not decoder.lm_head and not isinstance(decoder.drafter_head, LMHead):
            report["draft_head"] = _nbytes(decoder.draft_head)  # its int8 / bf16 head holds its own rows
            decoder.draft_head = ReleasedWeight(decoder.draft_head, "decoder.draft_head")
    head_rows = getattr(drafter, "draft_lm_head", None)
    if isinstance(head_rows, torch.Tensor) and not isinstance(head_rows, ReleasedWeight):
        report["draft_lm_head"] = _nbytes(head_rows)
        drafter.draft_lm_head = ReleasedWeight(head_rows, "drafter.draft_lm_head")
    if rows is not None:
        _release_embedding(decoder, rows, report)
    gc.collect()
    trim_heap()
    decoder.released_weights = report
    log.info("released the weights the native forward never reads: %s",
             ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in report.items()))
    return report
