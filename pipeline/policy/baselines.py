"""The baselines a user would reach for: transformers' own ``model.generate`` on the same target, and vLLM.

``TransformersGenerate`` is an ``ExternalDecode`` of the eval stage (methods ``hf_generate`` and
``hf_prompt_lookup`` of ``pipeline.policy.registry``): it decodes the request itself (``run_request``): greedy at
T=0 (the same text as ``ar`` in float32), sampled with transformers' sampler at T>0 (so its exact-match rate against
``ar`` is then below 1), plain or with prompt-lookup decoding (``prompt_lookup_num_tokens``). Its times are taken
like the decoder's: ``prefill_ms`` up to the first new token, ``decode_ms`` after it (CUDA synchronised), and
each step's new tokens (one per step, or the accepted lookup drafts + 1) are its ``taus``.
"""

from __future__ import annotations

import torch

from pipeline.decoding.schedules import ExternalDecode
from pipeline.decoding.requests import RequestStats
from pipeline.models.clock import now


class _StepClock:
    """A transformers streamer that records when each ``put`` came and how many tokens it held."""

    def __init__(self, device: torch.device):
        self.device, self.times, self.sizes = device, [], []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(now(self.device))
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


class TransformersGenerate(ExternalDecode):
    """``model.generate`` of the decoder's target as an eval method.

    Args:
        extra: further ``GenerationConfig`` fields (e.g. ``prompt_lookup_num_tokens``, ``max_matching_ngram_size``).
    Attributes:
        max_block_size: 1 (it never asks the drafter); static: False (its decodes are never shared).
    """

    def __init__(self, extra: dict | None = None):
        self.extra = dict(extra or {})

    @torch.inference_mode()
    def run_request(self, decoder, input_ids: torch.Tensor, config) -> RequestStats:
        """Decode one request ([1, n] or [n] prompt ids) with ``decoder.model.generate`` under ``config``
        (``DecodeConfig``: max_new_tokens, temperature, seed); stops at the decoder's stop tokens (kept in the output).

        Raises:
            ValueError / PromptTooLongError: for a prompt the decoder would refuse (``check_prompt``).
        """
        from transformers import GenerationConfig

        device = decoder.device
        input_ids = input_ids.reshape(1, -1).to(device)
        decoder.check_prompt(input_ids, config.max_new_tokens)
        stops = sorted(decoder.stop_ids)
        sample = float(config.temperature) > 0
        generation = GenerationConfig(
            max_new_tokens=int(config.max_new_tokens), do_sample=sample, temperature=float(config.temperature) if sample else None,
            top_k=None, top_p=None, min_p=None, repetition_penalty=None, eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else None, **self.extra)
        if sample:
            torch.manual_seed(int(config.seed))
        clock = _StepClock(device)
        t0 = now(device)
        out = decoder.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation,
                                     streamer=clock)
        t1 = now(device)
        new = out[0, input_ids.shape[1]:].tolist()
        stopped = bool(new) and new[-1] in decoder.stop_ids
        first = clock.times[1] if len(clock.times) > 1 else t1  # put 0 is the prompt, put 1 the prefill's tokens
        return RequestStats(prompt_tokens=input_ids.shape[1], output_ids=new, taus=clock.sizes[2:],
                            block_sizes=[], prefill_ms=(first - t0) * 1e3, decode_ms=(t1 - first) * 1e3, stopped=stopped)


class VllmGenerate(ExternalDecode):
    """vLLM's OpenAI server as an eval method (``vllm_ar``, ``vllm_dflash``, ``vllm_verify_width`` of
    ``pipeline.policy.registry``): each request goes to ``/v1/completions`` as the same prompt token ids, at the same
    ``max_tokens``, temperature, seed and stop tokens as our decoder's. Its ``prefill_ms`` is vLLM's own time to the
    first token and ``decode_ms`` the rest of the request's wall time (``--enable-per-request-metrics``); its ``taus``
    are vLLM's per-step accepted drafts + 1 (``--per-request-spec-decode-metrics detailed``, which lists the steps that
    verified drafts) and 1 for every other step (no speculation, or a step the plugin kept plain).

    The server (``pipeline.peers.vllm_server.VllmServer``, from ``.venv-vllm``: ``make vllm``) starts on the
    first request, on a free loopback port, and stops on ``close`` (or when this process exits). After each request it
    waits ``IDLE_S``: vLLM's workers keep polling their queue for a second after a step (``shm_broadcast``'s
    ``busy_loop_s``), which would slow whatever the eval stage decodes next on the same cores.

    Args:
        options: ``VllmServer`` fields (``method``, ``num_speculative_tokens``, ``policy``, ...).
    """

    IDLE_S = 1.5

    def __init__(self, options: dict):
        self.options = dict(options)
        self.server = None

    def _started(self):
        if self.server is None:
            import atexit
            import socket

            from pipeline.peers.vllm_server import VllmServer

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            options = {"max_num_seqs": 1, **self.options}
            options["extra_args"] = [*options.get("extra_args", []), "--enable-per-request-metrics"]
            self.server = VllmServer(port=port, **options).start()
            atexit.register(self.close)
        return self.server

    def close(self) -> None:
        """Stop the server (a no-op when it did not start)."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def run_request(self, decoder, input_ids: torch.Tensor, config) -> RequestStats:
        """Decode one request ([1, n] or [n] prompt ids) on vLLM under ``config`` (``DecodeConfig``).

        Raises:
            ValueError / PromptTooLongError: for a prompt the decoder would refuse (``check_prompt``).
            RuntimeError: when vLLM's server does not start (its log's last lines), or answers an error.
        """
        import json
        import time
        import urllib.error
        import urllib.request

        ids = input_ids.reshape(1, -1)
        decoder.check_prompt(ids, config.max_new_tokens)
        server = self._started()
        body = {"model": server.model, "prompt": ids[0].tolist(), "max_tokens": int(config.max_new_tokens),
                "temperature": float(config.temperature), "seed": int(config.seed), "return_token_ids": True,
                "stop_token_ids": sorted(decoder.stop_ids), "skip_special_tokens": False}
        request = urllib.request.Request(f"{server.openai_url}/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=3600) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"vLLM answered {err.code}: {err.read().decode(errors='replace')[:500]}") from err
        wall_ms = (time.perf_counter() - t0) * 1e3
        time.sleep(self.IDLE_S)
        tokens = [int(t) for t in answer["choices"][0]["token_ids"]]
        metrics = answer.get("metrics") or {}
        spec = metrics.get("speculative_decoding") or {}
        prefill_ms = float(metrics.get("time_to_first_token_ms") or 0.0)
        accepted, drafted = spec.get("per_step_accepted") or [], spec.get("per_step_drafted") or []
        taus = [int(a) + 1 for a in accepted]  # vLLM lists the steps that verified drafts; the others emit one token
        plain = max(0, len(tokens) - 1 - sum(taus))
        taus += [1] * plain
        return RequestStats(prompt_tokens=ids.shape[1], output_ids=tokens, taus=taus,
                            block_sizes=[int(d) + 1 for d in drafted] + [1] * plain,
                            verify_widths=[int(d) for d in drafted] + [0] * plain,
                            prefill_ms=prefill_ms, decode_ms=max(0.0, wall_ms - prefill_ms),
                            stopped=bool(tokens) and tokens[-1] in decoder.stop_ids)
