"""BlockPilot's vLLM integration (docs/vllm.md).

``plugin`` (vLLM's ``vllm.general_plugins`` entry point) and ``settings`` run in every vLLM process and import only the
standard library; ``model`` (our drafter class inside vLLM) and ``runtime`` (the hooks on vLLM's model runner) run in
vLLM's worker; ``policy`` (the per-step decisions), ``costs`` (the learned step costs) and ``labels`` (the label rows
and the calibration refit) are pure and tested without vLLM; ``server`` starts vLLM's OpenAI server from
``.venv-vllm`` (``make vllm``); ``check`` is ``make vllm``'s install check. Nothing is imported here.
"""
