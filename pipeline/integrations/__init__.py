"""BlockPilot inside other serving engines. ``vllm``: the plugin that applies our verify-width policies to vLLM's DFlash
speculative decoding, the launcher of vLLM's OpenAI server, and the labels of its traffic (docs/vllm.md).

This layer sits above ``pipeline.policy`` (it reads the calibration and the width choice) and ``pipeline.costs`` (the
monotone curve fit); nothing below imports it.
"""
