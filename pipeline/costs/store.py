"""The one per-machine cache of measured costs: one folder, one key builder, one writer.

Every per-machine measurement (the batch-1 step costs, the batched step costs, the smallm kernel's crossover, the
machine's limits, the vLLM plugin's learned step costs) is a file ``<dir>/<kind>-<hash of key>.json`` of one folder
(``default_dir()``: the config's ``paths.costs``), under a key built by ``key(kind, **fields)``: what the measurement
depends on (the models, the forward path, the arguments) plus this host's identity (``host()``: its name, CPU model,
CPU count, and torch's thread count and version when torch is loaded), in one place. A stored measurement is reused only
when its key matches and, when the caller gives one, a ``check`` of it against this machine now passes
(``pipeline.timing`` re-times a few points: a cache measured while other work shared the cores reads slower than the
machine is, and is then refused and measured again). Files are written atomically (``pipeline.files``).

Standard library only (the vLLM plugin reads it in vLLM's own process).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Mapping

from pipeline.files import write_json_atomic

log = logging.getLogger(__name__)

CACHE_ENV = "BLOCKPILOT_COST_CACHE"  # overrides the default folder (the measurements that have no config: crossover, limits)
VERSION = 3  # 3: one key builder (kind + host identity); older files are measured afresh


def default_dir() -> Path:
    """``$BLOCKPILOT_COST_CACHE``, else ``data/cache/costs`` of this checkout (the config's ``paths.costs``)."""
    from pipeline import DATA_DIR

    return Path(os.environ.get(CACHE_ENV) or DATA_DIR / "cache" / "costs")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host() -> dict:
    """This host's identity in every key: name, CPU model, CPU count and, when the process has loaded torch (every
    measuring process has), torch's thread count and version (read without importing it here)."""
    out = {"name": platform.node(), "cpu": cpu_name(), "cpus": os.cpu_count()}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        out.update(threads=torch.get_num_threads(), torch=str(torch.__version__))
    return out


def key(kind: str, **fields) -> dict:
    """The one key of a cached measurement: ``kind`` (its file's prefix), this ``host()`` and ``fields`` (what else it
    depends on: the models, the forward path, the arguments), JSON-plain."""
    return json.loads(json.dumps({"kind": str(kind), "host": host(), **fields, "version": VERSION}, default=str))


def path_of(cache_dir: str | Path, key: Mapping) -> Path:
    """Where the measurement of ``key`` (made by ``key()``) is stored: ``<cache_dir>/<kind>-<hash>.json``."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True, default=str).encode()).hexdigest()
    return Path(cache_dir) / f"{key['kind']}-{digest[:16]}.json"


def get(cache_dir: str | Path, key: Mapping, field: str) -> dict | None:
    """The measurement stored for ``key`` (``field`` of its file), or None (no file, an unreadable one, another key)."""
    path = path_of(cache_dir, key)
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if stored.get("key") != dict(key) or not stored.get(field):
        log.warning("costs: %s holds no measurement for this machine and key; measuring afresh", path)
        return None
    return stored[field]


def put(cache_dir: str | Path, key: Mapping, field: str, data: dict) -> Path:
    """Store ``data`` as the measurement of ``key`` (replacing any), atomically; returns the file."""
    path = path_of(cache_dir, key)
    write_json_atomic(path, {"key": dict(key), field: data}, indent=1, default=str, newline=False)
    return path


def cached(cache_dir: str | Path, key: Mapping, field: str, measure: Callable[[], dict],
           check: Callable[[dict], str | None] | None = None) -> dict:
    """The measurement stored for ``key`` (``field`` of its file), else ``measure()`` stored there.

    Args:
        check: given the stored measurement, a reason to refuse it (it is then measured afresh and replaced), or None.
    Returns:
        the measurement (a JSON-ready dict).
    """
    path = path_of(cache_dir, key)
    stored = get(cache_dir, key, field)
    if stored is not None:
        reason = check(stored) if check is not None else None
        if reason is None:
            log.info("costs: reusing the measurement stored for this machine in %s (delete it to measure again)", path)
            return stored
        log.warning("costs: refusing the measurement stored in %s: %s; measuring again", path, reason)
    else:
        log.info("costs: measuring this machine's %s once (kept in %s for later runs)", key["kind"], path)
    data = measure()
    put(cache_dir, key, field, data)
    log.info("costs: measurement stored for later runs in %s", path)
    return data
