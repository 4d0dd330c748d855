"""Labels from vLLM traffic: the plugin's per-step calibration samples, and the refit of ``calibration.json`` from them.

vLLM's own per-request metrics (``--per-request-spec-decode-metrics detailed``: each request's ``per_step_drafted``
and ``per_step_accepted`` in the response's ``metrics.speculative_decoding``) count drafts but hold no drafter
probabilities, which the calibration needs. The plugin sees both: the drafter's probability p_j of each draft when it
drafts, and, at the next step, how many of the k verified drafts the target accepted (a). With
``BLOCKPILOT_VLLM_LABELS=<file.jsonl>`` it appends one row per verified request-step, in the label store's ``conf_*``
columns (``pipeline.policy.calibration.calibration_samples``), the samples a replay records for one step:

    {"id": "<vLLM request id>", "source_set": "vllm", "step": <the worker's step>, "k": k, "accepted": a,
     "conf_block": [K + 1, ...], "conf_column": [1, ...], "conf_p": [p_1, ...], "conf_ok": [true, ...]}

with columns 1..min(k, a + 1): every accepted draft and the first rejected one (a column after a rejection is never
judged). Steps under the ``fixed`` policy verify every draft, so their samples cover every column; under
``verify_width`` / ``budget`` a column is sampled only when the policy verified it (mildly selected by the drafter's
probabilities, which the calibration conditions on).

``refit(logs, out_dir)`` reads such files (``read_rows``) and writes a ``calibration.json`` exactly as the train stage
does (``fit_from_labels`` + ``export_calibration``): ``make vllm-refit LOGS=... OUT=...``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterable, Sequence

SOURCE_SET = "vllm"


def step_row(request_id: str, step: int, block_size: int, confidence: Sequence[float], verified: int,
             accepted: int) -> dict | None:
    """The label row of one request-step (see the module docstring), or None when no draft was verified.

    Args:
        block_size: K + 1 (the drafter's drafts plus the verified token).
        confidence: the drafter's probabilities of its K drafts, in order.
        verified: k, the drafts the step verified; accepted: a (0..k), the drafts the target accepted.
    Raises:
        ValueError: for k outside 0..K or a outside 0..k.
    """
    k, a = int(verified), int(accepted)
    if not 0 <= k <= len(confidence) or not 0 <= a <= k:
        raise ValueError(f"need 0 <= accepted ({a}) <= verified ({k}) <= drafts ({len(confidence)})")
    if k == 0:
        return None
    m = min(k, a + 1)
    return {"id": str(request_id), "source_set": SOURCE_SET, "step": int(step), "k": k, "accepted": a,
            "conf_block": [int(block_size)] * m, "conf_column": list(range(1, m + 1)),
            "conf_p": [float(p) for p in confidence[:m]], "conf_ok": [j <= a for j in range(1, m + 1)]}


class LabelLog:
    """Appends label rows to a JSONL file (one ``write`` per step, flushed: a worker killed at shutdown loses nothing
    written before). Thread-safe.

    Attributes:
        rows: rows written by this process.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.rows = 0

    def write(self, rows: Iterable[dict]) -> None:
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
        if not text:
            return
        with self._lock, open(self.path, "a") as f:
            f.write(text)
            self.rows += text.count("\n")


def read_rows(logs: Sequence[str | Path]):
    """The label rows of JSONL files (or folders of ``*.jsonl``) as a DataFrame with the ``conf_*`` columns.

    Raises:
        FileNotFoundError: when no file is found; ValueError: when they hold no row.
    """
    import pandas as pd

    files: list[Path] = []
    for log in logs:
        path = Path(log)
        files.extend(sorted(path.glob("*.jsonl")) if path.is_dir() else [path] if path.is_file() else [])
    if not files:
        raise FileNotFoundError(f"no vLLM label log at {[str(p) for p in logs]}: serve with BLOCKPILOT_VLLM_LABELS="
                                "<file.jsonl> (the launcher's labels= option) and a policy other than off")
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"the vLLM label logs {[str(f) for f in files]} hold no row: no step verified a draft yet")
    return pd.DataFrame(rows)


def refit(logs: Sequence[str | Path], out_dir: str | Path, max_column: int = 16) -> Path:
    """Fit ``calibration.json`` on the samples of vLLM label logs and write it into ``out_dir`` (the reliability table on
    the same samples); returns its path.

    Raises:
        FileNotFoundError / ValueError: from ``read_rows``; ValueError from the fit (every sample accepted or rejected).
    """
    from pipeline.policy.calibration import export_calibration, fit_from_labels

    rows = read_rows(logs)
    fitted = fit_from_labels(rows, None, max_column=max_column,
                             info={"vllm_label_logs": [str(p) for p in logs], "rows": int(len(rows))})
    return export_calibration(out_dir, fitted)
