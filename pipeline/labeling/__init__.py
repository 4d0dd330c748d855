"""The label stage: oracle block sizes per prompt (tau(B) and tokens/s for every candidate B).

Modules: ``oracle`` (one prompt's label, label picking), ``brute`` (one decode per B), ``replay`` (one
target decode + batched drafter replays), ``store``
(sharded atomic Parquet + meta.json, resume, merge), ``runner`` (the stage loop, sharding).
The per-machine step cost model the replay's tokens/s come from is ``pipeline.costs``.
The replay function itself is ``pipeline.labeling.replay.replay`` (not re-exported: the name is the module's).
The package's API is imported on first use, so the stage's config check (``pipeline.labeling.checks``) loads no torch.
"""

import importlib

_EXPORTS = {"LabelSettings": "oracle", "label_prompt": "oracle", "pick_label": "oracle", "rank_agreement": "oracle",
            "target_trace": "replay", "LabelStore": "store", "merge_labels": "store", "read_labels": "store"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline.labeling' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipeline.labeling.{_EXPORTS[name]}"), name)
