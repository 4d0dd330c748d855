"""Serving: the OpenAI-compatible app (``app``, ``routes``, ``guards``), the one engine (``engine``: continuous
batching, ``serve.max_batch`` requests per step, 1 included), streaming text (``text``), the request/response schema
(``schemas``) and the recorder of served requests (``recorder``)."""
