"""The drafting gate's margin: a step drafts only where the modelled step with the drafts yields ``1 + GATE_MARGIN``
times the tokens per ms of the step without them (what the cost model leaves out: the drafter's Python work, sampling,
confidences, the allocation, and the priors' optimism).

One value for every gate (``pipeline.policy.core``, read by ``BudgetPolicy`` and the vLLM plugin's ``StepPolicy``),
kept at the bottom layer so that the plugin's settings (``pipeline.peers.vllm_settings``, standard library only: vLLM's
API server imports them) take their default from it too.
"""

GATE_MARGIN = 0.1
