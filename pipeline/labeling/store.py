"""The label store: sharded Parquet files written atomically, plus one ``meta.json`` per run.

Layout of ``data/labels/<run_name>/``::

    meta.json            run settings (target, drafter, candidates, mode, latency model, ...)
    shard-00000.parquet  rows of some requests (one row per request, schema ``LABEL_SCHEMA``)
    shard-00001.parquet  ...

Every worker (a Hydra multirun job, a torchrun rank, a SLURM array task, or a resumed run) appends
new ``shard-XXXXX.parquet`` files: a file is written under a hidden temporary name, then hard-linked
to the first free ``shard-XXXXX`` name (``os.link`` fails when the name exists, so concurrent workers
never overwrite each other) — a reader sees whole files or nothing. ``meta.json`` is written the same
way, first writer wins, and later workers check that their settings match it.

``read_labels`` merges every shard file of a directory (sorted by ``id``, de-duplicated), so the
dataset of n workers equals the dataset of one; ``merge_labels`` consolidates several directories
(e.g. one per machine) into one.

A shard file that cannot be read (truncated, empty, not Parquet) or lacks a column of ``LABEL_SCHEMA`` raises
``BadShardError`` naming the file and the fix. A resumed label run (``done_ids(set_aside_bad=True)``) moves such
a file into ``bad-shards/`` with a warning instead, so its requests are labelled again. Requests skipped because
they do not fit the target's context are listed in ``skipped.jsonl`` (``record_skipped``, ``read_skipped``).
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Iterable

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.files import create_once, move_aside, publish_new

log = logging.getLogger(__name__)

META_NAME = "meta.json"
SHARD_GLOB = "shard-*.parquet"
SKIPPED_NAME = "skipped.jsonl"
BAD_DIR = "bad-shards"


class BadShardError(ValueError):
    """A label shard file that is unreadable or lacks columns; the message names the file and the fix.

    Attributes:
        file: the shard file; problem: what is wrong with it.
    """

    def __init__(self, file: Path, problem: str):
        super().__init__(
            f"label shard {file} {problem}. Rerun the label stage on this directory with the same settings "
            f"(python -m pipeline.label run_name=... label.out_dir={file.parent}): it moves bad shards to "
            f"{file.parent / BAD_DIR} and labels their requests again; or delete {file.name}")
        self.file, self.problem = file, problem

LABEL_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source_set", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("candidates", pa.list_(pa.int64())),
    ("tau", pa.list_(pa.float64())),
    ("new_tokens", pa.list_(pa.float64())),
    ("decode_ms", pa.list_(pa.float64())),
    ("tokens_per_s", pa.list_(pa.float64())),
    ("label_tau", pa.int64()),
    ("label_speed", pa.int64()),
    ("topk_ids", pa.list_(pa.int64())),
    ("topk_logprobs", pa.list_(pa.float64())),
    ("full_logits", pa.binary()),
    ("vocab_size", pa.int64()),
    ("entropy", pa.float64()),
    ("prefill_ms", pa.float64()),
    ("shard", pa.int64()),
    ("num_shards", pa.int64()),
    ("conf_block", pa.list_(pa.int64())),
    ("conf_column", pa.list_(pa.int64())),
    ("conf_p", pa.list_(pa.float64())),
    ("conf_ok", pa.list_(pa.bool_())),
    ("conf_top_p", pa.list_(pa.list_(pa.float64()))),
    ("conf_rank", pa.list_(pa.int64())),
    ("reply_ids", pa.list_(pa.int64())),
])
"""One row per request (``id``: ``pipeline.prompts.request_id``). Per candidate B (lists in ``candidates`` order):
``tau`` (mean acceptance length, tokens), ``new_tokens``, ``decode_ms``, ``tokens_per_s``; the labels ``label_tau`` /
``label_speed`` (block sizes); the prefill's last-token distribution (``topk_ids``/``topk_logprobs``, ``full_logits``
as float16 bytes when kept, ``entropy`` in nats); ``prompt_tokens``, ``prefill_ms`` (ms) and the writing shard; the
verify-width calibration's samples from the replays (``conf_*``, one entry per sample: the step's block size, the
draft column j, the drafter's probability of its draft there, whether it was accepted, the probabilities of its
``label.tree_top_k`` best candidates there and the rank among them of the target's token, -1 for none: a draft
tree's samples; columns 1..first rejection of every step; empty in brute mode, null in shards written before they
existed); ``reply_ids``, the target's reply (token ids under the first seed; null in shards written before
2026-12-07), which ``policy.mixed.cache_seed=labels`` puts in the other splits' suffix cache."""

CONFIDENCE_COLUMNS = ("conf_block", "conf_column", "conf_p", "conf_ok", "conf_top_p", "conf_rank")
"""The replay samples' columns, in the order of a sample (the step's B, then ``ReplayResult.confidence``'s tuple)."""

OPTIONAL_COLUMNS = (*CONFIDENCE_COLUMNS, "reply_ids")
"""Columns a shard may lack (written by an earlier version of the label stage); read as nulls."""

# meta.json keys that must agree between workers writing the same directory
META_KEYS = ("target", "drafter", "training_block_size", "candidates", "temperature", "repeats", "seed",
             "max_new_tokens", "mode", "topk", "store_full_logits", "chat_template_kwargs")


def read_shard(file: str | Path, columns: list[str] | None = None) -> pa.Table:
    """One shard file as a table in ``LABEL_SCHEMA`` (or just ``columns`` of it).

    Raises:
        BadShardError: when the file is truncated, empty or not Parquet, lacks a ``LABEL_SCHEMA`` column, or holds a
            column of another type; the message names the file and the fix.
    """
    file = Path(file)
    try:
        names = pq.read_schema(file).names
    except (pa.ArrowException, OSError) as err:
        raise BadShardError(file, f"is not a readable Parquet file (truncated or empty?): {err}") from err
    missing = [c for c in LABEL_SCHEMA.names if c not in names and c not in OPTIONAL_COLUMNS]
    if missing:
        raise BadShardError(file, f"lacks columns {missing} (written by another version of the label stage?)")
    wanted = columns or LABEL_SCHEMA.names
    present = [c for c in wanted if c in names]
    try:
        table = pq.read_table(file, columns=present).cast(pa.schema([LABEL_SCHEMA.field(c) for c in present]))
    except (pa.ArrowException, OSError) as err:
        raise BadShardError(file, f"cannot be read in the label schema: {err}") from err
    for c in wanted:
        if c not in names:  # an optional column this shard predates
            table = table.append_column(LABEL_SCHEMA.field(c), pa.nulls(len(table), LABEL_SCHEMA.field(c).type))
    return table.select(wanted)


class LabelStore:
    """Reads and appends the shard files and ``meta.json`` of one label directory.

    Args:
        directory: ``data/labels/<run_name>``.
        create: create the directory when missing (writers); readers pass False.
    """

    def __init__(self, directory: str | Path, create: bool = True):
        self.directory = Path(directory)
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)

    # -- shards ----------------------------------------------------------------------------------
    def shard_files(self) -> list[Path]:
        """The published shard files, in name order."""
        return sorted(self.directory.glob(SHARD_GLOB)) if self.directory.is_dir() else []

    def done_ids(self, set_aside_bad: bool = False) -> set[str]:
        """Ids of every request already labelled in this directory (by any worker).

        Args:
            set_aside_bad: move unreadable shard files into ``bad-shards/`` (with a warning naming each) so that
                their requests count as not done and get labelled again (the resume path); False raises instead.
        Raises:
            BadShardError: for a bad shard file when ``set_aside_bad`` is False.
        """
        ids: set[str] = set()
        for file in self.shard_files():
            try:
                ids.update(read_shard(file, ["id"]).column("id").to_pylist())
            except BadShardError as err:
                if not set_aside_bad:
                    raise
                aside = self.directory / BAD_DIR / f"{file.stem}-{uuid.uuid4().hex[:8]}{file.suffix}"
                move_aside(file, aside)
                log.warning("label shard %s %s; moved it to %s: its requests will be labelled again", file, err.problem, aside)
        return ids

    def record_skipped(self, entries: list[dict]) -> None:
        """Append ``[{"id", "reason"}]`` of requests skipped by the label stage to ``skipped.jsonl`` (new ids only)."""
        known = {e["id"] for e in self.read_skipped()}
        lines = "".join(json.dumps(e) + "\n" for e in entries if e["id"] not in known)
        if lines:
            with (self.directory / SKIPPED_NAME).open("a") as f:  # one write per call: whole lines from each worker
                f.write(lines)

    def read_skipped(self) -> list[dict]:
        """The requests listed in ``skipped.jsonl`` (``[{"id", "reason"}]``; empty when none were skipped)."""
        path = self.directory / SKIPPED_NAME
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
        return out

    def write(self, rows: list[dict]) -> Path | None:
        """Write ``rows`` as one new shard file, atomically; returns its path (None for no rows).

        Raises:
            pyarrow.ArrowInvalid / ArrowTypeError: for a row that does not fit ``LABEL_SCHEMA``.
        """
        if not rows:
            return None
        table = pa.Table.from_pylist([{k: r.get(k) for k in LABEL_SCHEMA.names} for r in rows], schema=LABEL_SCHEMA)
        return publish_new(lambda tmp: pq.write_table(table, tmp), self.directory, "shard-{:05d}.parquet",
                           len(self.shard_files()))

    # -- meta --------------------------------------------------------------------------------------
    def read_meta(self) -> dict | None:
        """``meta.json`` as a dict, or None before the first worker wrote it."""
        path = self.directory / META_NAME
        return json.loads(path.read_text()) if path.is_file() else None

    def ensure_meta(self, meta: dict) -> dict:
        """Write ``meta`` unless a ``meta.json`` exists (first writer wins); return the stored one.

        Raises:
            ValueError: when the stored meta disagrees with ``meta`` on a key of ``META_KEYS`` (the
                directory holds labels made with other settings); the message names the fix.
        """
        stored = self.read_meta()
        if stored is None:
            text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
            create_once(self.directory / META_NAME, lambda tmp: tmp.write_text(text))  # else another worker was first
            stored = self.read_meta()
        check_meta_compatible(stored, meta, str(self.directory))
        return stored


def check_meta_compatible(stored: dict, wanted: dict, where: str) -> None:
    """Raise ``ValueError`` when two metas differ on a key of ``META_KEYS``."""
    def value(meta: dict, k: str):  # labels made before chat_template_kwargs was recorded used none
        return (meta.get(k) or {}) if k == "chat_template_kwargs" else meta.get(k)

    diff = {k: (value(stored, k), value(wanted, k)) for k in META_KEYS if value(stored, k) != value(wanted, k)}
    if diff:
        details = "; ".join(f"{k}: stored {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"labels in {where} were made with other settings ({details}). Use another run_name "
            "(run_name=...) or label.out_dir, or delete that directory to start over."
        )


def read_labels(directory: str | Path) -> pd.DataFrame:
    """All label rows of a directory as one DataFrame, sorted by ``id``, one row per id.

    When two workers labelled the same prompt (e.g. a run restarted with a different sharding), the
    row of the first shard file in name order is kept.

    Raises:
        FileNotFoundError: when the directory holds no shard file (run ``make label`` first).
        BadShardError: for a truncated, empty or garbled shard file or one missing a column (names the file and the fix).
    """
    files = LabelStore(directory, create=False).shard_files()
    if not files:
        raise FileNotFoundError(f"no {SHARD_GLOB} in {directory}; run the label stage first (make label)")
    table = pa.concat_tables([read_shard(f) for f in files])
    frame = table.to_pandas()
    frame = frame.drop_duplicates("id", keep="first").sort_values("id", kind="mergesort")
    return frame.reset_index(drop=True)


# the columns every consumer of the labels (dataset stage, train's calibration, eval, the verify-width fit) needs
LABEL_COLUMNS = ("id", "source_set", "prompt_tokens", "candidates", "tau", "tokens_per_s", "label_tau", "label_speed",
                 "topk_ids", "topk_logprobs", "entropy", "vocab_size")


def read_label_table(labels_dir: str | Path) -> tuple[pd.DataFrame, dict]:
    """The label stage's rows (``read_labels``) and ``meta.json``, checked for the columns the later stages read.

    Returns:
        (one row per request, i.e. per labelled turn of a prompt, sorted by id; the parsed ``meta.json``, ``{}`` when absent).
    Raises:
        FileNotFoundError: when ``labels_dir`` holds no shards (run the label stage).
        ValueError: when required columns are missing.
    """
    labels_dir = Path(labels_dir)
    if not labels_dir.is_dir() or not any(labels_dir.glob("shard-*.parquet")):
        raise FileNotFoundError(f"no label shards (shard-*.parquet) in {labels_dir}; run the label stage first: "
                                "make label (python -m pipeline.label run_name=<run>)")
    df = read_labels(labels_dir)
    missing = [c for c in LABEL_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"labels in {labels_dir} lack columns {missing}; relabel with the current label stage")
    meta_path = labels_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return df, meta


def merge_labels(sources: Iterable[str | Path], out: str | Path) -> Path:
    """Consolidate the labels of several directories into ``out`` (one shard file + ``meta.json``).

    Args:
        sources: label directories with compatible metas (same ``META_KEYS``). The first source's meta
            (its latency model included) is kept.
        out: a new or empty directory.
    Returns:
        ``out``.
    Raises:
        ValueError: for incompatible metas or an ``out`` that already holds shard files.
    """
    sources = [Path(s) for s in sources]
    if not sources:
        raise ValueError("merge_labels needs at least one source directory")
    metas = [LabelStore(s, create=False).read_meta() for s in sources]
    if any(m is None for m in metas):
        raise ValueError(f"every source needs a meta.json: {[str(s) for s, m in zip(sources, metas) if m is None]}")
    for source, meta in zip(sources[1:], metas[1:]):
        check_meta_compatible(metas[0], meta, str(source))
        if meta.get("latency_model") != metas[0].get("latency_model"):
            log.warning("%s has another latency model than %s; keeping the first", source, sources[0])
    store = LabelStore(out)
    if store.shard_files():
        raise ValueError(f"{out} already holds shard files; merge into a new directory")
    frames = [read_labels(s) for s in sources]
    frame = pd.concat(frames).drop_duplicates("id", keep="first").sort_values("id", kind="mergesort")
    table = pa.Table.from_pandas(frame[LABEL_SCHEMA.names], schema=LABEL_SCHEMA, preserve_index=False)
    publish_new(lambda tmp: pq.write_table(table, tmp), store.directory, "shard-{:05d}.parquet", 0)
    store.ensure_meta(metas[0])
    return store.directory
