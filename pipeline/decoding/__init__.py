"""The one speculative decoding loop (B=1 is autoregressive), sampling, schedules and the batched step.

The package's API is imported on first use, so importing one light module (``pipeline.decoding.schedules``: torch
only) loads no model code (the vLLM plugin reads the budget policy, which subclasses ``BatchPolicy``).
"""

import importlib

_EXPORTS = {"DecodeConfig": "requests", "RequestStats": "requests", "SpeculativeDecoder": "speculative",
            "EMASchedule": "schedules", "ExternalDecode": "schedules", "FixedSchedule": "schedules",
            "Schedule": "schedules", "BatchPolicy": "schedules"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline.decoding' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipeline.decoding.{_EXPORTS[name]}"), name)
