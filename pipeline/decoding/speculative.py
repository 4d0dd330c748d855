"""The decoder: the loaded target and drafter on the forward path chosen at load, a request's prefill, and its decode
through the one decode step (``pipeline.decoding.step``: draft, verify a draft tree in one target forward, keep the
longest accepted path plus the bonus token) with N = 1.

Follows the generate loop of z-lab/dflash ``dflash/model.py``, with three changes: B is chosen per
request (and may change per step through a ``Schedule``), sampling at T>0 is position-keyed
(``pipeline.decoding.sampling``) so outputs do not depend on B, and B=1 runs the same loop with no
drafter call (plain autoregressive decoding).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator

import torch
from transformers import DynamicCache

from pipeline.decoding.requests import DecodeConfig, DecodeState, PrefillResult, Request, RequestStats, as_schedule
from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.schedules import Schedule
from pipeline.models.backend import SMALLM_MAX_ROWS
from pipeline.models.cache import PreallocatedCache
from pipeline.models.clock import now
from pipeline.models.drafter import DFlashDrafter, check_compatible
from pipeline.models.forward import Forward, forward_for
from pipeline.models.target import Target, new_cache


class PromptTooLongError(ValueError):
    """A request whose prompt plus ``max_new_tokens`` does not fit the target's context (a ``ValueError``).

    The label and eval stages skip such a request with a warning naming it instead of stopping the run.
    """


class SpeculativeDecoder:
    """DFlash speculative decoding with a per-request block size (batch size 1).

    Args:
        target: the loaded target.
        drafter: a ``DFlashDrafter`` for this target, or None (autoregressive only).
        backend: the forward path of every target and drafter forward (``pipeline.models.backend``):
            ``eager``, ``onednn`` or ``smallm`` (float32 CPU), or ``auto``. It is set on the target's and drafter's
            modules, so prefill, autoregressive steps, drafts and verifies all run on it.
        kv_cache: the target's KV cache (``pipeline.models.target.new_cache``): ``dynamic``, ``preallocated`` or
            ``auto``; kept resolved in ``self.kv_cache``.
        fast_forward: ``model.fast_forward``: run the target's and the drafter's forwards on the native stacks
            (``pipeline.models.forward``): ``auto`` (where they can run), True (required: raises naming why not) or
            False (transformers' forward). ``self.native`` and ``self.native_draft`` hold them or None; which forward
            runs is chosen once, by ``pipeline.models.forward.forward_for``.
        precision: ``exact`` (every product on the weights' exact float32 values; the reference), ``int8`` (the native
            stack's 4-bit products on activations quantized to int8 per group of 32, AVX-512 VNNI, prefills included;
            the q8 LM head on int8 products too) or ``auto`` (``int8`` where the target runs on the native stack and
            the CPU has AVX-512 VNNI, else ``exact``: ``pipeline.models.native.resolve_precision``), kept resolved in
            ``self.precision``. Every method of one decoder runs on the same one, so speculation stays lossless
            against that decoder's own autoregressive text.
        draft_precision: the drafter's products on its native forward (``pipeline.models.native.resolve_draft_precision``):
            ``auto`` (``int8`` where the CPU has AVX-512 VNNI, else ``bf16`` where it has AVX-512 BF16, else ``exact``),
            ``exact``, ``bf16`` (bf16 weights, the drafter's stored form, times activations rounded to bf16: half the
            bytes and twice the multiply rate) or ``int8`` (weights rounded to q8 per group of 32, activations to int8,
            VNNI; the draft head too). It changes which drafts are proposed, never the output; kept resolved in
            ``self.draft_precision``.
        kv_dtype: ``model.kv_cache_dtype``, the element of the target's KV cache on the native stack
            (``pipeline.models.native.resolve_kv_dtype``: ``auto`` is bfloat16 with int8 products, else float32), kept
            resolved in ``self.kv_dtype``.
        prefill_chunk: the most prompt tokens one prefill forward takes (None or 0: the whole prompt in one forward);
            a longer prompt is prefilled chunk by chunk over its growing cache (``prefill_steps``), so that a batching
            server can run the other requests' steps between two chunks. The chunks are a function of the prompt
            alone (and of the prefix cache's hit), so a request prefilled between other work gets the same bits as one
            prefilled alone.
        prefix_cache: a ``pipeline.decoding.prefix_cache.PrefixCache`` of this decoder's prompt prefixes, or None (the
            default: every prompt is prefilled whole). Set as an attribute (``pipeline.serve.build_engine`` does);
            consulted only where ``prefill_invariant``, so a hit gives the bits of a full prefill.

    Raises:
        ValueError: when the drafter does not fit the target (hidden size, vocab, layer ids), or for a
            backend that cannot run here, an unknown ``kv_cache``, or a negative ``prefill_chunk``.
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None, backend: str = "eager",
                 kv_cache: str = "auto", fast_forward: bool | str = "auto", prefill_chunk: int | None = None,
                 precision: str = "exact", draft_precision: str | None = "auto", kv_dtype: str | None = "auto"):
        if prefill_chunk is not None and int(prefill_chunk) < 0:
            raise ValueError(f"model.prefill_chunk must be >= 0 tokens (0: no chunking), got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk) if prefill_chunk else None
        self.target = target
        self.model = target.model
        self.base = target.model.base_model
        self.lm_head = target.model.get_output_embeddings().weight
        self.embed = target.model.get_input_embeddings()
        self.drafter = drafter
        self.draft_head = self.draft_vocab = None
        if drafter is not None:
            check_compatible(drafter, target.model.config, target.name)
            self.draft_head = drafter.draft_head(self.lm_head)  # [N, H] rows the drafter scores
            self.draft_vocab = drafter.draft_vocab
        path = forward_for(target.model, drafter, self.draft_head, backend, kv_cache, fast_forward, precision,
                           draft_precision, kv_dtype)
        self.backend, self.precision, self.kv_cache, self.kv_dtype = (path.backend, path.precision, path.kv_cache,
                                                                       path.kv_dtype)
        self.native, self.draft_precision, self.native_draft = path.native, path.draft_precision, path.native_draft
        # [..., H] -> [..., V] target logits as the model computes them (bias, scaling, softcapping), in float32 for a
        # bf16/fp16 model (a bf16 product rounds logits to bf16's grid: ties a verify and single steps break differently)
        self.head, self.drafter_head = path.head, path.drafter_head
        self.max_context = int(getattr(target.model.config, "max_position_embeddings", 1 << 30))
        self.stop_ids = set(target.stop_token_ids())
        self.prefix_cache = None  # a PrefixCache (pipeline.decoding.prefix_cache) the prefills consult, or None

    @functools.cached_property
    def forward(self) -> Forward:
        """The forwards every decode step and prefill runs (``pipeline.models.forward.Forward``: one target and one
        drafter forward over the rows of any number of requests, each request's rows bit for bit its forward alone)."""
        return Forward(self)

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        """Bytes of the target's KV cache per token of context (keys and values of every layer)."""
        config = self.model.config
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return 2 * int(config.num_hidden_layers) * heads * head_dim * (self.kv_dtype if self.native is not None
                                                                          else self.model.dtype).itemsize

    @property
    def device(self) -> torch.device:
        return self.lm_head.device  # the model's (``model.device`` walks its parameters: ~25 us, four times a step)

    @property
    def prefill_invariant(self) -> bool:
        """Whether a prefill's bits (last logits, features, the cache's keys and values) do not depend on how the prompt
        is split into forwards: the target runs on the native stack (each row's products and attention are one fixed
        computation whatever the chunk). Only then does a prefill resume from a prefix cache's hit (``prefix_cache``):
        elsewhere (transformers' forward picks kernels by shape) a hit could change the last bits, and a prompt's output
        would depend on what was served before it."""
        return self.native is not None

    def forward_path(self) -> dict:
        """What this decoder's timings and exactness depend on beyond the models, in six keys: ``backend`` (the linears'
        backend with a hash of its kernel and formats, and its ISA), ``target`` (``native`` or ``transformers <dtype>
        <device>``, and why ``auto`` fell back where the kernel's build failed), ``precision`` (the target's products: exact or
        int8), ``drafter`` (``native <draft precision>``, ``transformers`` or None), ``kv_cache`` (its kind, and ``bf16``
        where it holds bfloat16), and
        ``batch_invariant``: whether each row's result is the same bits whatever the rows sharing the call, on which
        losslessness (every B's output = autoregressive) rests; where False, speculative outputs can differ from
        autoregressive ones by near-ties (report the exact-match rate: ``bench_label check=true``). Cache keys of timed
        results include it; results.json, /health and the bench JSONs record it."""
        from pipeline.models.backend import SMALLM, backend_signature, batch_invariant
        from pipeline.models.kernel import kernel_failure, kernel_isa

        failure = kernel_failure()
        backend = backend_signature(self.backend) + (f" {kernel_isa()}" if self.backend in SMALLM else "")
        target = "native" if self.native is not None else f"transformers {str(self.model.dtype)[6:]} {self.device}"
        target += f" (smallm failed: {failure})" if failure else ""
        drafter = None if self.drafter is None else (f"native {self.draft_precision}" if self.native_draft is not None
                                                     else "transformers")
        return {"backend": backend, "target": target, "precision": self.precision, "drafter": drafter,
                "kv_cache": self.kv_cache + (" bf16" if self.kv_dtype == torch.bfloat16 else ""),
                "batch_invariant": batch_invariant(self.backend) and self.device.type == "cpu"}

    # ---------------------------------------------------------------------------------------------
    def check_block_size(self, block_size: int) -> None:
        """Raise ``ValueError`` unless 1 <= B <= the drafter's limit (B=1 needs no drafter)."""
        if block_size < 1:
            raise ValueError(f"block size must be >= 1 (1 = autoregressive), got {block_size}")
        if block_size > 1 and self.drafter is None:
            raise ValueError(f"block size {block_size} needs a drafter; load one (model.drafter=...) or use B=1")
        if self.drafter is not None and block_size > self.drafter.max_block_size:
            raise ValueError(
                f"block size {block_size} is beyond this drafter's limit {self.drafter.max_block_size} "
                f"(trained at B={self.drafter.block_size}); pick B in 1..{self.drafter.max_block_size}"
            )

    def check_prompt(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        """Raise ``ValueError`` for an empty prompt, or ``PromptTooLongError`` for one that leaves no room for ``max_new_tokens``."""
        n = input_ids.shape[-1]
        if n == 0:
            raise ValueError("prompt is empty: give at least one token (check the prompt set's 'turns')")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if n + max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt of {n} tokens + max_new_tokens {max_new_tokens} exceeds the target's context of "
                f"{self.max_context} tokens; shorten the prompt or lower decode.max_new_tokens"
            )

    # ---------------------------------------------------------------------------------------------
    def target_forward(self, ids: torch.Tensor, cache: DynamicCache, start: int, want_features: bool,
                       last_only: bool = False, parents: list[int] | None = None):
        """Target forward over ``ids`` [1, q] at positions start..start+q-1, appending to ``cache``: a request's forward
        alone (its prefill chunks), on ``self.forward`` as every step's.

        Args:
            want_features: also return the drafter's context features of the q positions.
            last_only: logits of the last position only (a prefill).
            parents: None (causal rows), or a draft tree's parent of each row (-1: the pending token): row j sits at
                position start + its depth and attends to the cache, its ancestors and itself.
        Returns:
            (logits [q or 1, V] float32, features [1, q, n_taps*H] or None).
        """
        (logits, features), = self.forward.target([ids], [cache], [start], [want_features],
                                                  None if parents is None else [parents], last_only=last_only)
        return logits, features

    def draft_forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache
                      ) -> torch.Tensor:
        """The drafter's forward as this decoder runs it (the native draft stack where it runs, on its draft precision;
        else the drafter's own): block embeddings [1, b, H] with pending context features [1, c, F] at ``positions``
        [1, c + b], appended to the draft ``cache`` -> the final states [1, b, H]."""
        return self.forward.draft_embedded([embeds], [features], [positions], [cache])[0]

    def new_draft_cache(self):
        """An empty drafter cache for this decoder's draft forward (preallocated on the native draft path)."""
        native = self.native_draft is not None and self.native_draft.native_stack() is not None
        return PreallocatedCache() if native else DynamicCache()

    def new_state(self, prefill: PrefillResult, use_drafter: bool) -> DecodeState:
        """The state right after ``prefill``: its cache, features and first token (shared, not copied)."""
        return DecodeState(prefill.cache, self.new_draft_cache() if use_drafter else None,
                           prefill.features if use_drafter else None, prefill.first_token,
                           prefill.input_ids.shape[1])

    def prefill(self, input_ids: torch.Tensor, config: DecodeConfig, want_features: bool = True) -> PrefillResult:
        """Run the target over the prompt (in chunks of ``prefill_chunk`` tokens) and sample the first new token.

        Args:
            input_ids: [1, n] or [n] prompt token ids.
            want_features: keep the drafter's context features (needs a drafter).
        Raises:
            ValueError: for an empty prompt or one that leaves no room for ``config.max_new_tokens``.
        """
        for result in self.prefill_steps(input_ids, config, want_features):
            pass
        return result

    @torch.inference_mode()  # on a generator: in inference mode during each ``next``
    def prefill_steps(self, input_ids: torch.Tensor, config: DecodeConfig, want_features: bool = True
                      ) -> Iterator[PrefillResult | None]:
        """``prefill`` one chunk per ``next``: yields None after every chunk of at most ``prefill_chunk`` tokens but
        the last, then the ``PrefillResult`` (its ``prefill_ms`` sums the chunks' forwards, not the time between them).

        With a ``prefix_cache`` (and ``prefill_invariant``), the prompt's longest stored prefix (whole blocks, strictly
        shorter than the prompt, with drafter features when they are wanted) is copied into the request's own cache and
        only the tokens after it are prefilled, still in chunks of ``prefill_chunk``; the stored features are joined
        with the new ones. The prompt's full blocks are stored before the result is yielded (its cache is still the
        prompt's alone). The result's ``cached_tokens`` counts the prompt tokens that came from the cache;
        ``prefill_ms`` includes the copies in and out of it.

        Raises:
            ValueError: at the first ``next``, as ``prefill``.
        """
        input_ids = input_ids.reshape(1, -1).to(self.device)
        self.check_prompt(input_ids, config.max_new_tokens)
        sampler = PositionKeyedSampler(config.temperature, config.seed, self.lm_head.shape[0])
        n = input_ids.shape[1]
        chunk = self.prefill_chunk or n
        # room for the prompt, every new token and a verify's rows: one buffer per layer, no growth while decoding
        cache = new_cache(self.model, self.kv_cache, tokens=n + config.max_new_tokens + SMALLM_MAX_ROWS)
        want = want_features and self.drafter is not None
        features, spent, hit = [], 0.0, 0
        prefixes = self.prefix_cache
        if prefixes is not None and not (prefixes.enabled and prefixes.supports(cache) and self.prefill_invariant):
            prefixes = None
        if prefixes is not None:
            t0 = now(self.device)
            hit, prefix = prefixes.lookup(input_ids[0], want_features=want)
            if prefix is not None:
                cached = prefixes.restore(prefix, cache)
                if want:
                    features.append(cached)
            spent += now(self.device) - t0
        for start in range(hit, n, chunk):
            t0 = now(self.device)
            last_logits, part = self.target_forward(input_ids[:, start: start + chunk], cache, start,
                                                    want_features=want, last_only=True)
            if part is not None:
                features.append(part)
            if start + chunk < n:
                spent += now(self.device) - t0
                yield None
                continue
            first = int(sampler.pick(last_logits, n)[0])
            joined = None if not features else features[0] if len(features) == 1 else torch.cat(features, dim=1)
            if prefixes is not None:
                prefixes.store(input_ids[0], cache, joined)
            spent += now(self.device) - t0
            yield PrefillResult(input_ids, cache, last_logits[0], joined, first, spent * 1e3, cached_tokens=hit)

    @torch.inference_mode()
    def decode(self, prefill: PrefillResult, schedule: Schedule | int, config: DecodeConfig,
               on_tokens: Callable[[list[int]], bool | None] | None = None) -> RequestStats:
        """Decode after ``prefill`` with block sizes from ``schedule`` (an int means a fixed B): the request's life is
        ``pipeline.decoding.requests.Request``'s, as in a batch.

        Args:
            on_tokens: called with the new token ids of the prefill's first token and then of every
                step (accepted drafts + bonus, the stop token included), in order; a true return ends
                the decode after that step (a server's stop string or a client that went away).
        Returns:
            ``RequestStats`` with the output ids and per-step tau. The output never exceeds
            ``config.max_new_tokens`` and ends at the first stop token.
        Raises:
            ValueError: for a block size out of range (checked at every step).
        """
        from pipeline.decoding.schedules import BatchPolicy
        from pipeline.decoding.step import advance

        req = Request.begin(self, prefill, schedule, config, on_tokens=on_tokens)
        policy = BatchPolicy()
        while not req.done:  # the one step (``pipeline.decoding.step``) with one request
            news, sizes, _ = advance(self.forward, policy, [req])
            req.record(news[0], sizes[0], now(self.device))
        return req.stats

    def generate(self, input_ids: torch.Tensor, schedule: Schedule | int, config: DecodeConfig,
                 on_tokens: Callable[[list[int]], bool | None] | None = None) -> RequestStats:
        """Prefill then decode one request; see ``prefill`` and ``decode``."""
        schedule = as_schedule(self, schedule)
        prefill = self.prefill(input_ids, config, want_features=schedule.max_block_size > 1)
        return self.decode(prefill, schedule, config, on_tokens)
