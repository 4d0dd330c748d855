"""An automatic prefix cache for the target's KV cache (vLLM's "automatic prefix caching", on one CPU decoder).

Multi-turn chats and requests that share a system prompt would otherwise prefill their whole history every time.
``PrefixCache`` keeps, for the full blocks of ``block_tokens`` tokens of every prompt prefilled, the target's keys and
values of those positions (every layer, cloned out of the request's cache) and, when that prefill computed them, the
drafter's context features; a later prompt that starts with the same blocks restores them into a cache of its own and
prefills only the rest (``SpeculativeDecoder.prefill_steps``).

How it is keyed (vLLM's design doc "Automatic Prefix Caching"): block i of a prompt is identified by the hash of
(block i-1's key, the tokens of block i), a hash chain over block-granular prefixes, so equal keys mean equal prefixes
and blocks shared by many prompts (a system prompt) are stored once. The hash is only an index: a hit also compares
every block's own tokens and its parent block (no false hit from a hash collision). Only full blocks are stored, and a
lookup returns the longest stored block-aligned prefix strictly shorter than the prompt: at least one token must run
through the target to give the last position's logits (vLLM's ``max_cache_hit_length = num_tokens - 1``).

Eviction: least recently used first, bounded by ``max_bytes`` (the stored tensors' bytes). A lookup or store touches
its whole chain, leaf first and root last, so a block is always more recent than every block below it: the least
recently used block has no children, and eviction never leaves a block without its prefix.

Features: a block stored without drafter features (its prefill did not want them: ``B = 1`` only) cannot serve a
request that wants them; such a lookup stops at the first block without features (those tokens are a miss), and a
later prefill that computes them fills them in.

Counters, with vLLM's meanings (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, counted in
``KVCacheManager.get_computed_blocks``): ``queries`` adds every looked-up prompt's length in tokens, ``hits`` the
tokens its hit covered.

Exactness: restoring a prefix gives the bits of a full prefill only where a prefill's bits do not depend on how the
prompt is split into forwards (``SpeculativeDecoder.prefill_invariant``: the native stack); the decoder consults its
prefix cache only there. One ``PrefixCache`` serves one decoder (its model, precision and forward path): the stored
keys are that decoder's. Only caches whose every layer is a full-attention ``DynamicLayer`` or ``PreallocatedLayer``
are stored (``supports``): a sliding-window layer keeps no earlier positions to cut a prefix from.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from pipeline.models.cache import PreallocatedLayer

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # vLLM's default block size
MIB = 1 << 20


def _as_array(ids) -> np.ndarray:
    """Prompt token ids (a [n] or [1, n] tensor, or a sequence of ints) as a 1-D int64 array."""
    if isinstance(ids, torch.Tensor):
        return ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
    return np.asarray(list(ids), dtype=np.int64).reshape(-1)


def block_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The hash-chain key of a block: BLAKE2b-128 of (the parent block's key, ``b""`` for the first block; the block's
    token ids as int64 bytes)."""
    return hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class Block:
    """One stored block of a prefix.

    Attributes:
        key: its hash-chain key; parent: the block before it (None for a prompt's first block);
        tokens: its token ids; kv: [layers, 2 (keys, values), kv_heads, block_tokens, head_dim] of its positions;
        features: [1, block_tokens, F] drafter features of its positions, or None; children: stored blocks after it;
        nbytes: bytes of ``kv`` and ``features``.
    """

    key: bytes
    parent: "Block | None"
    tokens: tuple[int, ...]
    kv: torch.Tensor
    features: torch.Tensor | None = None
    children: int = 0
    nbytes: int = 0


@dataclass
class CachedPrefix:
    """A hit: the stored blocks of a prompt's first ``tokens`` tokens, in order (``PrefixCache.lookup``)."""

    blocks: list[Block] = field(default_factory=list)
    tokens: int = 0

    def kv(self) -> torch.Tensor:
        """[layers, 2, kv_heads, tokens, head_dim]: the prefix's keys and values (a new tensor)."""
        return torch.cat([b.kv for b in self.blocks], dim=3)

    def features(self) -> torch.Tensor | None:
        """[1, tokens, F]: the prefix's drafter features (a new tensor), or None where a block has none."""
        if any(b.features is None for b in self.blocks):
            return None
        return torch.cat([b.features for b in self.blocks], dim=1)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class PrefixCache:
    """Stored prompt prefixes of one decoder's target (see the module docstring).

    Args:
        max_bytes: the most bytes of stored keys, values and features (least recently used blocks are evicted past
            it); 0 disables the cache (``lookup`` misses without counting, ``store`` keeps nothing).
        block_tokens: tokens per block: hits are multiples of it.
    Attributes:
        queries: prompt tokens looked up; hits: prompt tokens served from the cache (vLLM's counters).
    Raises:
        ValueError: for a negative ``max_bytes`` or ``block_tokens`` < 1.
    """

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if int(max_bytes) < 0:
            raise ValueError(f"a prefix cache's max_bytes must be >= 0 (0: off), got {max_bytes}")
        if int(block_tokens) < 1:
            raise ValueError(f"a prefix cache's block_tokens must be >= 1, got {block_tokens}")
        self.max_bytes, self.block_tokens = int(max_bytes), int(block_tokens)
        self.queries = self.hits = 0
        self.bytes = 0
        self.layout: tuple | None = None  # (layers, kv_heads, head_dim, dtype) of the stored keys, set by the first store
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    # -- what it holds ---------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def entries(self) -> int:
        """Blocks stored."""
        return len(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        """What ``/health`` shows: size, use and the counters (plain numbers: safe to read from another thread)."""
        return {"max_bytes": self.max_bytes, "block_tokens": self.block_tokens, "bytes": self.bytes,
                "entries": self.entries, "tokens": self.entries * self.block_tokens, "queries": self.queries,
                "hits": self.hits, "hit_rate": self.hits / self.queries if self.queries else 0.0}

    def clear(self) -> None:
        """Drop every stored block (the counters stay)."""
        with self._lock:
            self._blocks.clear()
            self.bytes = 0

    @staticmethod
    def supports(cache) -> bool:
        """Whether ``cache``'s layers can be stored and restored: a non-empty list of full-attention ``DynamicLayer`` /
        ``PreallocatedLayer`` (transformers' sliding-window and other layer kinds cannot give back a prefix)."""
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(type(layer) in (DynamicLayer, PreallocatedLayer) for layer in layers)

    # -- lookup and restore ----------------------------------------------------------------------------------------
    def lookup(self, ids, want_features: bool = False) -> tuple[int, CachedPrefix | None]:
        """The longest stored block-aligned prefix of ``ids`` strictly shorter than it, touched as recently used, and
        counted (``queries`` += the prompt's length, ``hits`` += the tokens hit).

        Args:
            ids: the prompt's token ids ([n] or [1, n] tensor, or a sequence of ints).
            want_features: the request wants drafter features: only blocks that hold them can serve it.
        Returns:
            (tokens hit, the ``CachedPrefix``), or (0, None) on a miss.
        """
        if not self.enabled:
            return 0, None
        arr = _as_array(ids)
        n, bt = arr.shape[0], self.block_tokens
        with self._lock:
            chain: list[Block] = []
            parent, key = None, b""
            for i in range((n - 1) // bt if n else 0):
                tokens = arr[i * bt: (i + 1) * bt]
                key = block_key(key, tokens)
                block = self._blocks.get(key)
                if (block is None or block.parent is not parent or block.tokens != tuple(tokens.tolist())
                        or (want_features and block.features is None)):
                    break
                chain.append(block)
                parent = block
            self._touch(chain)
            hit = len(chain) * bt
            self.queries += int(n)
            self.hits += hit
        return (hit, CachedPrefix(chain, hit)) if chain else (0, None)

    def restore(self, prefix: CachedPrefix, cache) -> torch.Tensor | None:
        """Fill the empty ``cache`` (a request's, from ``pipeline.models.target.new_cache``, sized for the whole request
        by its ``tokens``) with ``prefix``'s keys and values, copied: the request's cache shares no storage with the
        stored blocks (its decode writes into it).

        Returns:
            [1, tokens, F] the prefix's drafter features (a new tensor), or None where its blocks hold none.
        Raises:
            ValueError: for a cache that is not empty, not ``supports``-ed, or whose layer count differs from the stored.
        """
        if not self.supports(cache) or cache.get_seq_length() != 0:
            raise ValueError("a prefix is restored into an empty cache of full-attention layers (PrefixCache.supports)")
        kv = prefix.kv()
        if kv.shape[0] != len(cache.layers):
            raise ValueError(f"the stored prefix has {kv.shape[0]} layers, the cache {len(cache.layers)}: one "
                             "PrefixCache serves one decoder")
        for i, layer in enumerate(cache.layers):
            keys, values = kv[i, 0][None], kv[i, 1][None]
            # a preallocated layer copies into a buffer of its own; a dynamic one keeps the tensors it is given
            layer.update(*((keys, values) if isinstance(layer, PreallocatedLayer) else (keys.clone(), values.clone())))
        return prefix.features()

    # -- store -----------------------------------------------------------------------------------------------------
    def store(self, ids, cache, features: torch.Tensor | None = None) -> int:
        """Store the full blocks of a just-prefilled prompt (blocks already stored are shared, given features they
        lacked, and touched), then evict least recently used blocks past ``max_bytes``.

        Args:
            ids: the prompt's token ids; cache: the target's cache right after its prefill (its first tokens are the
                prompt's; nothing is aliased: the blocks are copies); features: [1, >= n, F] the prompt's drafter
                features, or None.
        Returns:
            the number of blocks newly stored.
        Raises:
            ValueError: for a cache whose layer layout differs from the stored ones (one PrefixCache per decoder).
        """
        if not self.enabled or not self.supports(cache):
            return 0
        arr = _as_array(ids)
        bt = self.block_tokens
        layers = cache.layers
        first = layers[0].keys
        if first is None or any(layer.keys is None or layer.keys.shape != first.shape or layer.keys.dtype != first.dtype
                                or layer.values is None or layer.values.shape != first.shape for layer in layers):
            return 0
        if first.shape[0] != 1:
            return 0
        layout = (len(layers), int(first.shape[1]), int(first.shape[3]), first.dtype)
        per_block = len(layers) * 2 * first.shape[1] * bt * first.shape[3] * first.element_size()
        if features is not None:
            per_block += bt * features.shape[-1] * features.element_size()
        blocks = min(arr.shape[0], cache.get_seq_length()) // bt
        blocks = min(blocks, self.max_bytes // per_block)
        if features is not None:
            blocks = min(blocks, features.shape[1] // bt)
        if blocks == 0:
            return 0
        with self._lock:
            if self.layout is None:
                self.layout = layout
            elif self.layout != layout:
                raise ValueError(f"this prefix cache holds keys of layout {self.layout}, not {layout}: one PrefixCache "
                                 "serves one decoder")
            chain: list[Block] = []
            parent: Block | None = None
            fresh, first_new, added = None, 0, 0
            for i in range(blocks):
                tokens = arr[i * bt: (i + 1) * bt]
                key = block_key(parent.key if parent is not None else b"", tokens)
                block = self._blocks.get(key)
                if block is None:
                    if fresh is None:  # the keys and values of every block from here on, one copy
                        first_new = i
                        fresh = torch.stack([torch.stack((layer.keys[0, :, i * bt: blocks * bt],
                                                          layer.values[0, :, i * bt: blocks * bt])) for layer in layers])
                    s = (i - first_new) * bt
                    block = Block(key, parent, tuple(tokens.tolist()), fresh[:, :, :, s: s + bt].clone(),
                                  None if features is None else features[:, i * bt: (i + 1) * bt].clone())
                    block.nbytes = _nbytes(block.kv) + _nbytes(block.features)
                    if parent is not None:
                        parent.children += 1
                    self._blocks[key] = block
                    self.bytes += block.nbytes
                    added += 1
                elif block.parent is not parent or block.tokens != tuple(tokens.tolist()):
                    break  # a hash collision with another stored prefix: keep that one, store nothing further
                elif features is not None and block.features is None:
                    block.features = features[:, i * bt: (i + 1) * bt].clone()
                    block.nbytes += _nbytes(block.features)
                    self.bytes += _nbytes(block.features)
                chain.append(block)
                parent = block
            self._touch(chain)
            self._evict()
        return added

    # -- LRU -------------------------------------------------------------------------------------------------------
    def _touch(self, chain: Sequence[Block]) -> None:
        """Mark ``chain`` (a prefix's blocks, root first) most recently used, its root last (see the module doc)."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def shrink(self, limit_bytes: int) -> None:
        """Drop least recently used blocks until ``bytes`` <= ``limit_bytes`` (the room a server's KV budget leaves
        beside its running requests' reservations: ``pipeline.decoding.scheduler.Scheduler``)."""
        with self._lock:
            self._evict(min(self.max_bytes, max(0, int(limit_bytes))))

    def _evict(self, limit: int | None = None) -> None:
        """Drop least recently used blocks until ``bytes`` <= ``limit`` (default ``max_bytes``; each a leaf: see the
        module doc)."""
        limit = self.max_bytes if limit is None else limit
        while self.bytes > limit and self._blocks:
            _, block = self._blocks.popitem(last=False)
            assert block.children == 0, "the least recently used block has stored children"
            if block.parent is not None:
                block.parent.children -= 1
            self.bytes -= block.nbytes


def prefix_cache_for(decoder, max_mib: float) -> PrefixCache | None:
    """A ``PrefixCache`` of ``max_mib`` MiB for ``decoder`` (``serve.prefix_cache_mb``), or None: for 0, and, with a
    warning, where a hit would not give a full prefill's bits (``SpeculativeDecoder.prefill_invariant``: prefills off
    the native stack) or the target's KV cache has layers a prefix cannot be cut from (``PrefixCache.supports``).

    Raises:
        ValueError: for a negative size.
    """
    from pipeline.models.target import new_cache

    if max_mib < 0:
        raise ValueError(f"serve.prefix_cache_mb must be >= 0 MiB (0: off), got {max_mib}")
    if max_mib == 0:
        return None
    if not decoder.prefill_invariant:
        log.warning("serve.prefix_cache_mb=%s: no prefix cache: prefills on this forward path (model.backend=%s) are not "
                    "the same bits whatever their chunks, so a hit could change outputs; it needs the native stack "
                    "(model.backend=smallm with model.fast_forward on)", max_mib, decoder.backend)
        return None
    if not PrefixCache.supports(new_cache(decoder.model, decoder.kv_cache)):
        log.warning("serve.prefix_cache_mb=%s: no prefix cache: the target's KV cache has layers a prefix cannot be cut "
                    "from (sliding window)", max_mib)
        return None
    return PrefixCache(int(max_mib * MIB))
