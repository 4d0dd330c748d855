"""The plugin's settings (environment variables read in every vLLM process), the vLLM version it was written for, and
the per-request opt-out. Standard library only: vLLM's API server imports this at startup through the plugin.

Environment (``BLOCKPILOT_VLLM_*``; the launcher ``pipeline.peers.vllm_server`` sets them from its options):

==================================  ==========================================================================
``BLOCKPILOT_VLLM_POLICY``          ``off`` (default: the plugin does nothing), ``fixed`` (verify every draft;
                                    honours the opt-out and logs labels), ``verify_width`` (each request's k
                                    alone), ``budget`` (the step's verify rows shared across requests)
``BLOCKPILOT_VLLM_CALIBRATION``     calibration.json (or its folder); default: the drafter folder's
``BLOCKPILOT_VLLM_CACHE``           folder of the learned step-cost curves (default: the one per-machine cost
                                    cache, ``pipeline.costs.store.default_dir()``: ``$BLOCKPILOT_COST_CACHE``,
                                    else ``<checkout>/data/cache/costs``)
``BLOCKPILOT_VLLM_LABELS``          a JSONL file: one label row per verified request-step (default: none)
``BLOCKPILOT_VLLM_MARGIN``          the drafter runs only where the modelled step beats the plain one by this
                                    fraction (default ``pipeline.policy.budget.GATE_MARGIN``, 0.1)
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
from pathlib import Path

VLLM_SERIES = "0.32."  # the vLLM release series whose internals the plugin wraps
POLICIES = ("off", "fixed", "verify_width", "budget")
SPECULATE_KEY = "blockpilot_speculate"
ENV_PREFIX = "BLOCKPILOT_VLLM_"
DEFAULT_MARGIN = 0.1  # = pipeline.policy.budget.GATE_MARGIN (kept here: this module imports no torch)
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
    margin: float = DEFAULT_MARGIN
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
        if policy not in POLICIES:
            raise ValueError(f"{ENV_PREFIX}POLICY={policy!r} is not one of {list(POLICIES)}; unset it (off) or pick one")
        return cls(policy=policy, calibration=env.get(ENV_PREFIX + "CALIBRATION") or None,
                   cache_dir=env.get(ENV_PREFIX + "CACHE") or None, labels=env.get(ENV_PREFIX + "LABELS") or None,
                   margin=number("MARGIN", float, DEFAULT_MARGIN, 0.0),
                   max_skip=number("MAX_SKIP", int, DEFAULT_MAX_SKIP, 0),
                   explore=number("EXPLORE", int, DEFAULT_EXPLORE, 1),
                   save_every_s=number("SAVE_EVERY_S", float, DEFAULT_SAVE_EVERY_S, 0.0))

    def to_env(self) -> dict[str, str]:
        """The environment variables that make ``from_env`` return these settings (unset ones left out)."""
        out = {"POLICY": self.policy, "CALIBRATION": self.calibration, "CACHE": self.cache_dir, "LABELS": self.labels,
               "MARGIN": repr(self.margin), "MAX_SKIP": str(self.max_skip), "EXPLORE": str(self.explore),
               "SAVE_EVERY_S": repr(self.save_every_s)}
        return {ENV_PREFIX + k: str(v) for k, v in out.items() if v is not None}


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
