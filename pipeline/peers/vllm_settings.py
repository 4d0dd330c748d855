"""The plugin's settings (environment variables read in every vLLM process), the vLLM version it was written for, and
the per-request opt-out. Standard library only (and the cost model's ``GATE_MARGIN``, which imports no more): vLLM's
API server imports this at startup through the plugin.

Environment (``BLOCKPILOT_VLLM_*``; the launcher ``pipeline.peers.vllm_server`` sets them from its options):

==================================  ==========================================================================
``BLOCKPILOT_VLLM_POLICY``          ``off`` (default: the plugin does nothing), ``fixed`` (verify every draft;
                                    honours the opt-out and logs labels), ``per_request`` (each request's k
                                    alone), ``joint`` (the step's verify rows shared across requests); both gate
                                    the whole step's drafter (``pipeline.policy.core`` tells them from the
                                    registry's ``verify_width`` / ``budget``, their names before issue 41:
                                    refused now, ``RENAMED``)
``BLOCKPILOT_VLLM_CALIBRATION``     calibration.json (or its folder); default: the drafter folder's
``BLOCKPILOT_VLLM_CACHE``           folder of the learned step-cost curves (default: the one per-machine cost
                                    cache, ``pipeline.costs.store.default_dir()``: ``$BLOCKPILOT_COST_CACHE``,
                                    else ``<checkout>/data/cache/costs``)
``BLOCKPILOT_VLLM_LABELS``          a JSONL file: one label row per verified request-step (default: none)
``BLOCKPILOT_VLLM_MARGIN``          the drafter runs only where the modelled step beats the plain one by this
                                    fraction (default ``pipeline.costs.margin.GATE_MARGIN``, 0.1)
``BLOCKPILOT_VLLM_MAX_SKIP``        the longest run of steps without the drafter before it drafts again to
                                    refresh its priors (default 32)
``BLOCKPILOT_VLLM_EXPLORE``         samples each step-cost bucket needs before the policy trusts it (default 3)
``BLOCKPILOT_VLLM_SAVE_EVERY_S``    seconds of serving between two saves of the learned step costs (default 5),
                                    besides the save when the worker stops; 0: only when it stops
==================================  ==========================================================================

A request opts out of speculation with ``extra_args`` ``{"blockpilot_speculate": false}`` (OpenAI clients: the body's
``vllm_xargs``); its drafts are then never verified, whatever the policy (except ``off``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.costs.margin import GATE_MARGIN

VLLM_SERIES = "0.32."  # the vLLM release series whose internals the plugin wraps
POLICIES = ("off", "fixed", "per_request", "joint")
# vLLM without speculation, with its DFlash drafter, with its n-gram (prompt lookup) proposer, or with suffix decoding
# (ArcticInference's suffix trees; needs the arctic-inference package in vLLM's environment)
METHODS = ("ar", "dflash", "ngram", "suffix")
# the plugin's policies' names before issue 41 (the registry's methods of those names gate and skip per request)
RENAMED = {"verify_width": "per_request", "budget": "joint"}
SPECULATE_KEY = "blockpilot_speculate"
ENV_PREFIX = "BLOCKPILOT_VLLM_"
DEFAULT_MAX_SKIP = 32
DEFAULT_EXPLORE = 3
DEFAULT_SAVE_EVERY_S = 5.0


@dataclass(frozen=True)
class Settings:
    """The plugin's settings (see the module docstring for each).

    Raises:
        ValueError: from ``from_env`` for an unknown policy or a malformed number; the message names the variable.
    """

    policy: str = "off"
    calibration: str | None = None
    cache_dir: str | None = None
    labels: str | None = None
    margin: float = GATE_MARGIN
    max_skip: int = DEFAULT_MAX_SKIP
    explore: int = DEFAULT_EXPLORE
    save_every_s: float = DEFAULT_SAVE_EVERY_S

    @property
    def active(self) -> bool:
        """Whether the plugin changes anything (any policy but ``off``)."""
        return self.policy != "off"

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "Settings":
        env = os.environ if environ is None else environ

        def number(name: str, kind, default, low):
            raw = env.get(ENV_PREFIX + name)
            if raw in (None, ""):
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{name}={raw!r} is not a {kind.__name__}; unset it for the default "
                                 f"({default})") from None
            if value < low:
                raise ValueError(f"{ENV_PREFIX}{name}={raw!r} must be >= {low}")
            return value

        policy = (env.get(ENV_PREFIX + "POLICY") or "off").strip().lower()
        check_policy(policy, f"{ENV_PREFIX}POLICY")
        if policy not in POLICIES:
            raise ValueError(f"{ENV_PREFIX}POLICY={policy!r} is not one of {list(POLICIES)}; unset it (off) or pick one")
        return cls(policy=policy, calibration=env.get(ENV_PREFIX + "CALIBRATION") or None,
                   cache_dir=env.get(ENV_PREFIX + "CACHE") or None, labels=env.get(ENV_PREFIX + "LABELS") or None,
                   margin=number("MARGIN", float, GATE_MARGIN, 0.0),
                   max_skip=number("MAX_SKIP", int, DEFAULT_MAX_SKIP, 0),
                   explore=number("EXPLORE", int, DEFAULT_EXPLORE, 1),
                   save_every_s=number("SAVE_EVERY_S", float, DEFAULT_SAVE_EVERY_S, 0.0))

    def to_env(self) -> dict[str, str]:
        """The environment variables that make ``from_env`` return these settings (unset ones left out)."""
        out = {"POLICY": self.policy, "CALIBRATION": self.calibration, "CACHE": self.cache_dir, "LABELS": self.labels,
               "MARGIN": repr(self.margin), "MAX_SKIP": str(self.max_skip), "EXPLORE": str(self.explore),
               "SAVE_EVERY_S": repr(self.save_every_s)}
        return {ENV_PREFIX + k: str(v) for k, v in out.items() if v is not None}


def check_policy(policy: str, where: str) -> None:
    """Refuse a plugin policy's name from before issue 41 (``RENAMED``), naming the new one.

    Raises:
        ValueError: for ``verify_width`` or ``budget`` (the message names ``where`` the value came from).
    """
    if policy in RENAMED:
        raise ValueError(f"{where}={policy!r}: the plugin's {policy!r} is now {RENAMED[policy]!r} (it gates the whole "
                         f"step's drafter, unlike the registry's {policy} method; pipeline/policy/core.py): use "
                         f"{RENAMED[policy]!r}")


def check_server(method: str, policy: str, num_speculative_tokens: int, key: str = "vllm") -> None:
    """Check a vLLM server's method, plugin policy and K (``pipeline.peers.vllm_server.VllmServer`` and the
    serve_vllm stage's config check).

    Raises:
        ValueError: for the first bad value, naming ``key``'s setting.
    """
    if method not in METHODS:
        raise ValueError(f"{key}.method must be one of {list(METHODS)}, got {method!r}")
    check_policy(policy, f"{key}.policy")
    if policy not in POLICIES:
        raise ValueError(f"{key}.policy (the plugin's policy) must be one of {list(POLICIES)}, got {policy!r}")
    if method != "dflash" and policy != "off":
        raise ValueError(f"{key}.policy={policy} applies to dflash: use {key}.method=dflash or {key}.policy=off")
    if method != "ar" and int(num_speculative_tokens) < 1:
        raise ValueError(f"{method} drafts K >= 1 tokens per step, got {key}.num_speculative_tokens={num_speculative_tokens}")


def check_serve_vllm_config(cfg) -> None:
    """The serve_vllm stage's check (``conf/serve_vllm.yaml``): ``check_server`` on ``vllm.*`` and its port.

    Raises:
        ValueError: for the first bad value, naming the key.
    """
    v = cfg.vllm
    check_server(str(v.get("method")), str(v.get("policy")), int(v.get("num_speculative_tokens") or 0))
    port = v.get("port")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"vllm.port must be a TCP port number (1..65535), got {port!r}")


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release whose internals the plugin was not written for.

    Raises:
        RuntimeError: for any version outside ``VLLM_SERIES`` (names the version, the fix and the way out).
    """
    if not str(version).startswith(VLLM_SERIES):
        raise RuntimeError(f"BlockPilot's vLLM plugin wraps internals of vLLM {VLLM_SERIES}x (GPUModelRunner."
                           f"propose_draft_token_ids / take_draft_token_ids, DFlashQwen3ForCausalLM.compute_logits); "
                           f"this is vLLM {version}. Install {VLLM_SERIES}x (make vllm) or run without the plugin "
                           f"({ENV_PREFIX}POLICY=off)")


def speculates(extra_args) -> bool:
    """Whether a request's ``SamplingParams.extra_args`` let it speculate (``{"blockpilot_speculate": false}`` opts out).

    Raises:
        ValueError: for a value that is not a boolean (or "true"/"false", 0/1).
    """
    if not extra_args or SPECULATE_KEY not in extra_args:
        return True
    value = extra_args[SPECULATE_KEY]
    if isinstance(value, bool) or value in (0, 1):  # vllm_xargs may arrive as 0/1 (its values are str | int | float)
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"extra_args {SPECULATE_KEY}={value!r} must be true or false")
