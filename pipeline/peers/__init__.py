"""The field's own engines as peers, below decoding: vLLM's OpenAI server started as a process of ``.venv-vllm``
(``vllm_server``) and the settings its plugin reads (``vllm_settings``; standard library only, so the plugin in vLLM's
own environment imports them too). The plugin that runs inside vLLM sits above the policies
(``pipeline.integrations.vllm``)."""
