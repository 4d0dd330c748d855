"""vLLM's DFlash drafter model with the drafter's probability of each draft recorded (imported by vLLM's model
registry in the worker process, through ``pipeline.integrations.vllm.plugin``).

``BlockPilotDFlashQwen3ForCausalLM`` is vLLM 0.32's ``DFlashQwen3ForCausalLM``
(``vllm/model_executor/models/qwen3_dflash.py:771``) with ``compute_logits`` (there at :835) computing, besides the
logits, each row's largest probability under the drafter's own (draft-vocabulary) logits: what greedy drafting picks
(``SpecDecodeBaseProposer._greedy_sample``, ``vllm/v1/spec_decode/llm_base_proposer.py:438``, argmax of these
logits) and what BlockPilot's calibration reads (``pipeline.decoding.sampling.draft_confidence`` at T = 0). Rows are
request-major, K per request (llm_base_proposer.py:620). Its constructor installs the policy's hooks on vLLM's model
runner (``pipeline.integrations.vllm.runtime.install``).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM


def max_probability(logits: torch.Tensor) -> torch.Tensor:
    """[R] float32: each row's largest softmax probability of ``logits`` [R, V] (finite rows)."""
    logits = logits.float()
    return (logits.amax(-1) - torch.logsumexp(logits, -1)).exp()


class BlockPilotDFlashQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's DFlash drafter plus ``confidence``: [R] the probability of each row's draft at the last
    ``compute_logits`` call (None before one, or while the plugin does not need it)."""

    BLOCKPILOT_DRAFTER = True  # runtime.is_ours

    def __init__(self, *, vllm_config, prefix: str = ""):
        """vLLM's constructor, then the plugin's hooks (``runtime.install``).

        Raises:
            RuntimeError: under vLLM's V2 model runner (the hooks are on V1: unset ``VLLM_USE_V2_MODEL_RUNNER``).
            FileNotFoundError / ValueError: without a usable calibration for the policy (``runtime.calibration_of``).
        """
        if vllm_config.use_v2_model_runner:
            raise RuntimeError("BlockPilot's vLLM plugin hooks vLLM's V1 model runner, and this engine runs V2: set "
                               "VLLM_USE_V2_MODEL_RUNNER=0, or BLOCKPILOT_VLLM_POLICY=off to serve without the plugin")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.confidence: torch.Tensor | None = None
        self.record_confidence = True
        from pipeline.integrations.vllm import runtime

        runtime.calibration_of(runtime.Settings.from_env(), str(vllm_config.speculative_config.model))  # fail at load
        runtime.install()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """``DFlashQwen3ForCausalLM.compute_logits`` (the same operations), recording ``confidence`` from the
        draft-vocabulary logits before they are scattered to the target's vocabulary."""
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None:
            return None
        self.confidence = max_probability(logits) if self.record_confidence else None
        if self.draft_id_to_target_id is None:
            return logits
        base = torch.arange(self.config.draft_vocab_size, device=logits.device)
        targets = base + self.draft_id_to_target_id
        logits_new = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        logits_new[:, targets] = logits
        return logits_new
