"""BlockPilot's vLLM integration (docs/vllm.md).

``plugin`` (vLLM's ``vllm.general_plugins`` entry point) runs in every vLLM process and imports only the standard
library (with ``pipeline.peers.vllm_settings``, the settings it reads); ``model`` (our drafter class inside vLLM) and
``runtime`` (the hooks on vLLM's model runner) run in vLLM's worker; ``policy`` (the per-step decisions), ``costs`` (the
learned step costs) and ``labels`` (the label rows and the calibration refit) are pure and tested without vLLM;
``check`` is ``make vllm``'s install check. vLLM's OpenAI server is started from ``.venv-vllm`` (``make vllm``) by
``pipeline.peers.vllm_server``. Nothing is imported here.
"""
