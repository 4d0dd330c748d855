"""The label stage: oracle block sizes per prompt (tau(B) and tokens/s for every candidate B).

Modules: ``oracle`` (one prompt's label, label picking), ``brute`` (one decode per B), ``replay`` (one
target decode + batched drafter replays), ``store``
(sharded atomic Parquet + meta.json, resume, merge), ``runner`` (the stage loop, sharding).
The per-machine step cost model the replay's tokens/s come from is ``pipeline.costs``.
The replay function itself is ``pipeline.labeling.replay.replay`` (not re-exported: the name is the module's).
"""

from pipeline.labeling.oracle import LabelSettings, label_prompt, pick_label, rank_agreement
from pipeline.labeling.replay import target_trace
from pipeline.labeling.store import LabelStore, merge_labels, read_labels

__all__ = ["LabelSettings", "LabelStore", "label_prompt", "merge_labels", "pick_label", "rank_agreement", "read_labels",
           "target_trace"]
