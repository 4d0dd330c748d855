"""Serving: the OpenAI-compatible app (``app``), the batch-1 engine with its policies (``engine``), streaming text
(``text``), the request/response schema (``schemas``) and the recorder of served requests (``recorder``)."""
