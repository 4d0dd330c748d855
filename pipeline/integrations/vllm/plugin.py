"""BlockPilot's vLLM plugin: the entry point vLLM calls in every process (``vllm.general_plugins``, pyproject.toml).

``register`` reads the settings (``pipeline.peers.vllm_settings``; environment variables). With the policy
``off`` (the default, so merely installing BlockPilot beside vLLM changes nothing) it returns at once. Otherwise it
refuses a vLLM outside the 0.32 series (the internals it wraps are version-specific) and maps the DFlash drafter's
architecture (``DFlashDraftModel``, the one z-lab's and our folders name) to ``pipeline.integrations.vllm.model``'s
subclass of vLLM's ``DFlashQwen3ForCausalLM``, imported lazily by vLLM in the process that builds the drafter (the
GPU/CPU worker). The hooks are on vLLM's V1 model runner, so it also sets ``VLLM_USE_V2_MODEL_RUNNER=0`` unless the
caller set it (vLLM on CPU without Triton picks V1 anyway). That subclass records each drafted position's probability and, when it is built, installs the
policy's hooks on the model runner (``pipeline.integrations.vllm.runtime``).

This module imports only the standard library and ``settings`` at import time: vLLM's API server and engine processes
load it too, and the test suite checks that importing it loads no model code.
"""

from __future__ import annotations

import logging
import os

from pipeline.peers.vllm_settings import Settings, check_vllm_version

log = logging.getLogger(__name__)

DRAFTER_ARCH = "DFlashDraftModel"
DRAFTER_CLASS = "pipeline.integrations.vllm.model:BlockPilotDFlashQwen3ForCausalLM"
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


def register() -> None:
    """Register BlockPilot's drafter class with vLLM when a policy is set (see the module docstring).

    Raises:
        ValueError: for malformed ``BLOCKPILOT_VLLM_*`` settings.
        RuntimeError: for a vLLM outside the 0.32 series while a policy is set.
    """
    settings = Settings.from_env()
    if not settings.active:
        return
    import vllm
    from vllm import ModelRegistry

    check_vllm_version(vllm.__version__)
    if os.environ.get(V2_RUNNER) is None:  # the hooks are on the V1 runner (where vLLM would pick V2: CUDA + Triton)
        os.environ[V2_RUNNER] = "0"
    ModelRegistry.register_model(DRAFTER_ARCH, DRAFTER_CLASS)
    log.info("BlockPilot vLLM plugin: policy %s (drafter class %s)", settings.policy, DRAFTER_CLASS)
