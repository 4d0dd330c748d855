"""A preallocated KV cache for the target: appends write into spare capacity instead of concatenating.

transformers' ``DynamicLayer.update`` appends with ``torch.cat([keys, new], dim=-2)`` per layer and per
forward, so every decode step copies the whole cache once (measured on SmolLM2-135M, 512-token context:
10.9 ms of a q=8 verify, 4.9 ms of a one-token step). ``PreallocatedLayer`` keeps each layer's keys and
values in a buffer ``[batch, kv_heads, capacity, head_dim]`` with room to spare, copies only the new
tokens into it, and exposes the filled part ``buffer[:, :, :length]`` as ``keys`` / ``values``; when full
it grows geometrically (doubling), so the amortized cost per token is constant. ``crop`` only moves the
length back; the next ``update`` overwrites the dropped positions.

``PreallocatedCache`` is a ``DynamicCache`` (same constructor, ``isinstance`` checks, masks and
sliding-window handling) whose full-attention layers are ``PreallocatedLayer``; every other layer kind
(sliding-window, chunked, linear attention, dummy) keeps transformers' own dynamic layer.

Aliasing rules (why this is safe for the decoder):

- ``keys`` / ``values`` and what ``update`` returns are views of the buffer. A position is rewritten only
  after a ``crop`` moved the length below it, so a view is stable until the next ``crop`` + ``update``.
  The attention of a forward consumes its views inside that forward, and nothing in BlockPilot keeps a
  cache layer's tensors across steps. Code that wants a snapshot must ``clone`` them (or ``deepcopy``
  the cache).
- ``copy.deepcopy`` gives every layer buffers of its own (the filled part copied), so a copy taken
  before decoding (``pipeline.labeling.brute``, ``pipeline.serving.engine``) is unaffected by later
  writes to the original, and vice versa.
- Growing allocates a new buffer; views handed out earlier keep the old one alive and unchanged.
- A buffer created under ``torch.inference_mode`` cannot be written in place outside it; such an update
  (and any update with autograd recording) first moves the data into a fresh buffer, as a concatenation
  would.
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.models.kernel import loaded_kernel

KINDS = ("auto", "dynamic", "preallocated")
# What ``auto`` resolves to under transformers' SDPA attention, chosen by `python -m pipeline.bench_step
# 'kv_caches=[dynamic,preallocated]'`: still "dynamic" (transformers' behaviour) until that benchmark has shown
# preallocated faster there; under the smallm kernel's attention ``auto`` is "preallocated" (``resolve_kv_cache``).
DEFAULT_KV_CACHE = "dynamic"
HEADROOM = 128  # tokens of spare capacity beyond what the first update (the prefill) needs


def resolve_kv_cache(kind: str | None, attention: str = "sdpa") -> str:
    """``auto`` / None -> the KV cache for a forward whose decode-step attention is ``attention``: ``preallocated`` for
    the smallm kernel's ``attend`` (it reads the cache through its strides, so the buffer's views give the same bits as
    a concatenated cache, without copying every cache every step), else ``DEFAULT_KV_CACHE``; ``dynamic`` and
    ``preallocated`` unchanged.

    Raises:
        ValueError: for any other name.
    """
    kind = "auto" if kind is None else str(kind)
    if kind not in KINDS:
        raise ValueError(f"kv_cache must be one of {list(KINDS)}, got {kind!r}")
    if kind != "auto":
        return kind
    return "preallocated" if attention == "kernel" else DEFAULT_KV_CACHE


def crop_to(cache: DynamicCache, length: int) -> None:
    """Roll ``cache`` back to its first ``length`` tokens (transformers 5 ``crop`` takes -tokens_to_drop)."""
    remove = cache.get_seq_length() - length
    if remove >= 0:  # crop(0) still trims sliding-window layers back to their window
        cache.crop(-remove)


def compact(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Keep, after the first ``start`` tokens, the tokens at offsets ``rows`` (increasing, after ``start``) in that order
    and drop the rest: a draft tree's accepted path moved behind the context (``pipeline.decoding.trees``)."""
    rows = [int(r) for r in rows]
    moved = [(i, r) for i, r in enumerate(rows) if r != i]
    kernel = loaded_kernel()
    buffers = _buffers(cache) if moved and kernel is not None else None
    if buffers is not None:  # one native call over every layer (two indexed copies per layer took ~0.9 ms on 30 layers)
        kernel.move_rows(buffers, [start + i for i, _ in moved], [start + r for _, r in moved])
    elif moved:
        dst = torch.tensor([start + i for i, _ in moved])
        src = torch.tensor([start + r for _, r in moved])
        with torch.inference_mode():
            for layer in cache.layers:
                if getattr(layer, "keys", None) is None:
                    continue
                layer.keys[:, :, dst] = layer.keys[:, :, src]  # gathered first, then written: overlaps are safe
                layer.values[:, :, dst] = layer.values[:, :, src]
    crop_to(cache, start + len(rows))


def _buffers(cache: DynamicCache) -> list[torch.Tensor] | None:
    """Every layer's key and value buffers where all of ``cache``'s layers are filled ``PreallocatedLayer``s writable
    here (a native ``move_rows`` may write them), else None."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, PreallocatedLayer) or not layer._writable():
            return None
        out += [layer._key_buffer, layer._value_buffer]
    return out


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer over a buffer with spare capacity (see the module docstring).

    Args:
        headroom: spare tokens allocated beyond the first update's length (None: the module's ``HEADROOM``, read
            when the layer is made); later growth doubles the capacity.
        tokens: the most tokens the layer is known to hold (a request's prompt, its ``max_new_tokens`` and a verify's
            rows, ``pipeline.models.target.new_cache``): the first buffer holds at least that many, so it never grows
            (nor holds twice its need after a doubling); None: no such bound.

    ``keys`` / ``values`` are always ``buffer[:, :, :length]`` (or None before the first update), so every
    ``DynamicLayer`` method that only reads them (``get_seq_length``, ``get_mask_sizes``) works unchanged.
    """

    _stale = False  # keys / values are out of date after ``reserve`` (refreshed when next read)
    _views = None  # (key buffer, value buffer, their [0] views) as ``reserve`` last returned them
    tokens = 0  # the most tokens the layer is known to hold (0: unknown)

    def __init__(self, headroom: int | None = None, tokens: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.headroom = int(HEADROOM if headroom is None else headroom)
        self.tokens = int(tokens or 0)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0

    # -- buffers ----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Tokens the current buffer holds before it must grow (0 before the first update)."""
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    # ``keys`` / ``values``: views of the filled part, made again lazily after ``reserve`` (which only moves the length)
    @property
    def keys(self) -> torch.Tensor | None:
        if self._stale:
            self._expose()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        if self._stale:
            self._expose()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value

    def _expose(self) -> None:
        """Point ``keys`` / ``values`` at the filled part of the buffers."""
        self._stale = False
        self._keys = self._key_buffer[:, :, : self._length]
        self._values = self._value_buffer[:, :, : self._length]

    def _reallocate(self, capacity: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        """New buffers of ``capacity`` tokens holding the filled part of the old ones (shapes and dtypes of ``like_*``)."""
        batch, heads = like_keys.shape[:2]
        keys = like_keys.new_empty((batch, heads, capacity, like_keys.shape[-1]))
        values = like_values.new_empty((batch, like_values.shape[1], capacity, like_values.shape[-1]))
        if self._length:
            keys[:, :, : self._length].copy_(self._key_buffer[:, :, : self._length])
            values[:, :, : self._length].copy_(self._value_buffer[:, :, : self._length])
        self._key_buffer, self._value_buffer = keys, values

    def _adopt(self) -> None:
        """Make ``keys`` / ``values`` (set by a ``DynamicLayer`` method that replaces them) the new buffers."""
        if self.keys is None or self.values is None:
            self._key_buffer = self._value_buffer = None
            self._length = 0
            return
        self._key_buffer, self._value_buffer = self.keys.contiguous(), self.values.contiguous()
        self._length = self._key_buffer.shape[-2]
        self._expose()

    def _writable(self) -> bool:
        """Whether the buffers can take an in-place write in the current autograd / inference mode."""
        if self._key_buffer is None:
            return False
        if self._key_buffer.is_inference() and not torch.is_inference_mode_enabled():
            return False
        return not (self._key_buffer.requires_grad or self._value_buffer.requires_grad)

    # -- the CacheLayerMixin API ------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor | None, value_states: torch.Tensor | None) -> None:
        self.device = key_states.device if key_states is not None else torch.device("cpu")
        self._key_buffer = self._value_buffer = None
        self._length = 0
        self._stale = False
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new ``[batch, kv_heads, q, head_dim]`` states after the cached ones; returns views of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            # autograd through the cache: concatenate as DynamicLayer does (no in-place writes in the graph)
            old_keys, old_values = (self.keys, self.values) if self._length else (key_states[:, :, :0], value_states[:, :, :0])
            self.keys = torch.cat([old_keys, key_states], dim=-2)
            self.values = torch.cat([old_values, value_states], dim=-2)
            self._adopt()
            return self.keys, self.values
        q = key_states.shape[-2]
        needed = self._length + q
        if needed > self.capacity:  # grow geometrically (the first buffer: the prefill + headroom)
            self._reallocate(max(needed, 2 * self.capacity) if self.capacity else max(needed + self.headroom, self.tokens),
                             key_states, value_states)
        elif not self._writable():  # an inference-mode buffer outside inference mode, or one in an autograd graph
            self._reallocate(self.capacity, key_states, value_states)
        self._key_buffer[:, :, self._length : needed].copy_(key_states)
        self._value_buffer[:, :, self._length : needed].copy_(value_states)
        self._length = needed
        self._expose()
        return self.keys, self.values

    def reserve(self, q: int, like: tuple[int, int, torch.dtype] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Make room for ``q`` new tokens after the cached ones and count them in, without writing them: the caller
        writes their keys/values into the buffers at positions ``length - q .. length - 1`` (the smallm kernel's
        ``attend`` does, in the same call as the attention). Cheaper than ``update`` when many requests append every
        layer (``pipeline.models.forward``).

        Args:
            like: (kv_heads, head_dim, dtype) of the states: a layer with no buffer yet (a fresh cache) gets one of
                ``q`` + headroom tokens; without it such a layer returns None.
        Returns:
            (key buffer [kv_heads, capacity, head_dim], value buffer, the new length), or None when an ``update``
            must run instead (no buffer yet and no ``like``, batch > 1, or one that cannot take in-place writes here).
        """
        if self._key_buffer is None and like is not None and not torch.is_grad_enabled():
            heads, dim, dtype = like
            if not self.is_initialized:
                self.lazy_initialization(None, None)
            size = max(q + self.headroom, self.tokens)
            self._key_buffer = torch.empty(1, heads, size, dim, dtype=dtype)
            self._value_buffer = torch.empty(1, heads, size, dim, dtype=dtype)
            self._length = 0
        views = self._views
        if views is None or views[0] is not self._key_buffer or views[1] is not self._value_buffer:
            if self._key_buffer is None or self._key_buffer.shape[0] != 1:
                return None
            kb, vb = self._key_buffer, self._value_buffer
            views = self._views = (kb, vb, kb[0], vb[0], kb.is_inference(), kb.requires_grad or vb.requires_grad)
        if views[5] or (views[4] and not torch.is_inference_mode_enabled()):  # ``_writable``, per buffer once
            return None
        needed = self._length + q
        if needed > views[0].shape[-2]:
            self._reallocate(max(needed, 2 * self.capacity), self._key_buffer, self._value_buffer)
            return self.reserve(q, like)
        self._length = needed
        self._stale = True
        return views[2], views[3], needed

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative int, as ``DynamicLayer.crop`` takes); no copy."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        if tokens_to_remove == 0 or not self.is_initialized or self._key_buffer is None:
            return
        self._length = max(0, self._length - abs(tokens_to_remove))
        self._stale = True  # keys / values made again when next read

    def reset(self) -> None:
        super().reset()  # drops keys / values and clears is_initialized
        self._key_buffer = self._value_buffer = None
        self._length = 0
        self._stale = False

    # methods of DynamicLayer / CacheLayerMixin that replace keys / values with new tensors: adopt those
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._adopt()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._adopt()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._adopt()

    def offload(self):
        super().offload()
        self._adopt()

    def prefetch(self):
        super().prefetch()
        self._adopt()

    def __deepcopy__(self, memo):
        """An independent layer: buffers of the same capacity of its own, holding a copy of the filled part."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        buffers = ("_keys", "_values", "_key_buffer", "_value_buffer", "_stale", "_views")
        for name, value in self.__dict__.items():
            if name not in buffers:
                setattr(new, name, copy.deepcopy(value, memo))
        new.keys = new.values = new._key_buffer = new._value_buffer = None
        if self._key_buffer is not None:
            new._key_buffer = self._key_buffer.new_empty(self._key_buffer.shape)
            new._value_buffer = self._value_buffer.new_empty(self._value_buffer.shape)
            new._key_buffer[:, :, : self._length].copy_(self._key_buffer[:, :, : self._length])
            new._value_buffer[:, :, : self._length].copy_(self._value_buffer[:, :, : self._length])
            new._expose()
        return new


class PreallocatedCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are ``PreallocatedLayer`` (no per-step concatenation).

    Args:
        config: the model's config, as for ``DynamicCache``: sliding-window / chunked / other layer kinds keep
            transformers' dynamic layers. Without one, layers are created lazily as ``PreallocatedLayer``.
        headroom: spare tokens of each layer's first buffer (see ``PreallocatedLayer``; None: ``HEADROOM``).
        tokens: the most tokens each layer is known to hold (``PreallocatedLayer``), or None.
    """

    def __init__(self, config=None, headroom: int | None = None, offloading: bool = False,
                 offload_only_non_sliding: bool = False, tokens: int | None = None):
        super().__init__(config=config, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        self.headroom = int(HEADROOM if headroom is None else headroom)
        layer = functools.partial(PreallocatedLayer, self.headroom, tokens)
        if self.layer_class_to_replicate is DynamicLayer:  # no config: layers made lazily, at their first update
            self.layer_class_to_replicate = layer
        self.layers = [layer() if type(x) is DynamicLayer else x for x in self.layers]


def reserve_rows(caches, rows, layers: int, like: tuple[int, int, torch.dtype]) -> tuple[list, list, list] | None:
    """Room for ``rows[i]`` new tokens in each of the first ``layers`` layers of ``caches[i]`` (``PreallocatedLayer.
    reserve``; a fresh ``PreallocatedCache`` makes its layers first, as its ``update`` would): the key and value buffers
    request-major (``[i * layers + l]``) and each request's new length, for a native call to write into. None, with
    nothing reserved, where some cache cannot take them (not preallocated, batch > 1, not writable here)."""
    keys, values, lengths, done = [], [], [], []
    for cache, r in zip(caches, rows):
        cache_layers = getattr(cache, "layers", None)
        if cache_layers is None:
            break
        while isinstance(cache, PreallocatedCache) and len(cache_layers) < layers:
            cache_layers.append(cache.layer_class_to_replicate())
        if len(cache_layers) < layers or not all(isinstance(x, PreallocatedLayer) for x in cache_layers[:layers]):
            break
        got = [x.reserve(r, like) for x in cache_layers[:layers]]
        done.append((cache_layers, got, r))
        if None in got:
            break
        for g in got:
            keys.append(g[0])
            values.append(g[1])
        lengths.append(got[0][2])
    else:
        return keys, values, lengths
    for cache_layers, got, r in done:  # undo what was reserved (nothing is written yet)
        for layer, g in zip(cache_layers, got):
            if g is not None:
                layer.crop(-r)
    return None
