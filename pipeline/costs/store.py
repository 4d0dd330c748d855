"""The one per-machine cache of measured costs: ``<dir>/<prefix>-<hash of key>.json``, written atomically.

Every per-machine measurement (the batch-1 step costs, the batched step costs, the smallm kernel's crossover) is kept
here under a key of what it depends on (the models, this host, torch's threads, the forward path, the arguments). A
stored measurement is reused only when its key matches and, when the caller gives one, a ``check`` of it against this
machine now passes (``pipeline.timing`` re-times a few points: a cache measured while other work shared the cores
reads slower than the machine is, and is then refused and measured again).

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Mapping

log = logging.getLogger(__name__)

CACHE_ENV = "BLOCKPILOT_COST_CACHE"  # overrides the default folder of the measurements that have no config (crossover)
VERSION = 2  # 2: interleaved rounds, shape check, spread stored; older files are measured afresh


def default_dir() -> Path:
    """``$BLOCKPILOT_COST_CACHE``, else ``data/cache/costs`` of this checkout."""
    from pipeline import DATA_DIR

    return Path(os.environ.get(CACHE_ENV) or DATA_DIR / "cache" / "costs")


def path_of(cache_dir: str | Path, prefix: str, key: Mapping) -> Path:
    """Where the measurement of ``key`` is stored."""
    digest = hashlib.sha256(json.dumps({**key, "version": VERSION}, sort_keys=True, default=str).encode()).hexdigest()
    return Path(cache_dir) / f"{prefix}-{digest[:16]}.json"


def write(path: Path, payload: Mapping) -> None:
    """``payload`` as JSON at ``path``, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def _plain(key: Mapping) -> dict:
    return json.loads(json.dumps({**key, "version": VERSION}, default=str))


def put(cache_dir: str | Path, prefix: str, key: Mapping, field: str, data: dict) -> Path:
    """Store ``data`` as the measurement of ``key`` (replacing any), atomically; returns the file."""
    path = path_of(cache_dir, prefix, key)
    write(path, {"key": _plain(key), field: data})
    return path


def cached(cache_dir: str | Path, prefix: str, key: Mapping, field: str, measure: Callable[[], dict],
           check: Callable[[dict], str | None] | None = None) -> dict:
    """The measurement stored for ``key`` (``field`` of its file), else ``measure()`` stored there.

    Args:
        check: given the stored measurement, a reason to refuse it (it is then measured afresh and replaced), or None.
    Returns:
        the measurement (a JSON-ready dict).
    """
    path = path_of(cache_dir, prefix, key)
    plain_key = _plain(key)
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError:
            stored = {}
        if stored.get("key") == plain_key and stored.get(field):
            reason = check(stored[field]) if check is not None else None
            if reason is None:
                log.info("costs: reusing the measurement stored for this machine in %s (delete it to measure again)", path)
                return stored[field]
            log.warning("costs: refusing the measurement stored in %s: %s; measuring again", path, reason)
        else:
            log.warning("costs: %s holds no measurement for this machine and forward path; measuring afresh", path)
    else:
        log.info("costs: measuring this machine's %s once (kept in %s for later runs)", prefix, path)
    data = measure()
    put(cache_dir, prefix, key, field, data)
    log.info("costs: measurement stored for later runs in %s", path)
    return data
