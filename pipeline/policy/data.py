"""The policy's data: label rows -> prefill-distribution features + reward vectors, split by prompt.

The library of the ``dataset`` stage (``python -m pipeline.dataset``, ``pipeline/dataset.py``), also used by the
train and eval stages, the verify-width calibration and the re-test (``pipeline.evaluation.retest``).

``read_label_table`` reads the label stage's rows (``data/labels/<run_name>/``); ``build_dataset`` computes the
features configured in ``conf/features/`` (``pipeline.policy.features``) and writes a ``datasets.DatasetDict``
with splits ``train``/``validation``/``test`` to ``data/features/<run_name>/<features.name>/`` (atomically), with
``blockpilot.json`` beside the splits (feature spec, candidates, target/drafter, split settings and counts);
``load_feature_dataset`` reads it back.

Columns: ``id``, ``source_set``, ``prompt_tokens``, ``x`` (float32 [dim]), for id features ``ids`` and
``id_weights`` ([k]), ``tau`` and ``tokens_per_s`` (float32 [C], one per candidate block size),
``label_tau``/``label_speed`` (block sizes, tokens) and ``label_tau_idx``/``label_speed_idx`` (class
indices), ``entropy`` (nats).

One row per request (every labelled turn of a prompt). Splits are by prompt id (all turns of a prompt
in one split), stratified by source set: every set's prompt ids are shuffled with a generator
seeded by (``dataset.seed``, set name) and cut by ``dataset.fractions``; the output depends only on the
labels and the config. With ``dataset.holdout_set=<name>`` that set goes entirely to ``test`` and the
other sets are split between ``train`` and ``validation`` only.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from pipeline.files import atomic_dir
from pipeline.policy.features import Featurizer, FeatureSpec
from pipeline.labeling.store import read_label_table
from pipeline.prompts import check_label_template_kwargs, prompt_id_of

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
INFO = "blockpilot.json"
# -- labels -------------------------------------------------------------------------------------------
def label_candidates(df: pd.DataFrame, meta: dict) -> list[int]:
    """The candidate block sizes shared by every label row.

    Raises:
        ValueError: when rows disagree (labels from different runs mixed in one directory).
    """
    candidates = [int(c) for c in (meta.get("candidates") or df["candidates"].iloc[0])]
    bad = df[[list(map(int, c)) != candidates for c in df["candidates"]]]
    if len(bad):
        raise ValueError(f"{len(bad)} label rows (e.g. {bad['id'].iloc[0]!r}) use other candidates than {candidates}; "
                         "label every prompt of a run with the same model.candidates")
    return candidates


# -- splits -------------------------------------------------------------------------------------------
def split_ids(df: pd.DataFrame, seed: int, fractions: dict[str, float], holdout_set: str | None = None) -> dict[str, list[str]]:
    """Assign label rows to train/validation/test by prompt, stratified by ``source_set``.

    Every turn of a prompt (request ids ``<id>``, ``<id>#turn2``, ...; ``pipeline.prompts.request_id``) goes
    to the same split, so no conversation is split between training and test.

    Args:
        df: label rows with ``id`` (request ids) and ``source_set``.
        seed: split seed; the assignment depends only on it, the ids and the fractions.
        fractions: ``{"train", "validation", "test"}`` shares summing to 1.
        holdout_set: a source set sent entirely to test (the others then fill train/validation only).
    Returns:
        ``{split: sorted request ids}``.
    Raises:
        ValueError: for bad fractions or an unknown ``holdout_set``.
    """
    fr = {s: float(fractions.get(s, 0.0)) for s in SPLITS}
    if any(v < 0 for v in fr.values()) or not math.isclose(sum(fr.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"dataset.fractions must be >= 0 and sum to 1, got {fr}")
    sets = sorted(df["source_set"].unique())
    if holdout_set is not None and holdout_set not in sets:
        raise ValueError(f"dataset.holdout_set={holdout_set!r} is not a labelled source set; choose one of {sets}")
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for name in sets:
        requests = sorted(df.loc[df["source_set"] == name, "id"].astype(str).unique())
        turns_of: dict[str, list[str]] = {}
        for rid in requests:  # the turns of one prompt stay in one split
            turns_of.setdefault(prompt_id_of(rid), []).append(rid)
        ids = sorted(turns_of)
        if name == holdout_set:
            out["test"] += requests
            continue
        random.Random(f"{seed}:{name}").shuffle(ids)
        shares = dict(fr)
        if holdout_set is not None:  # test is the held-out set only
            rest = shares["train"] + shares["validation"]
            shares = {"train": shares["train"] / rest, "validation": shares["validation"] / rest, "test": 0.0}
        n = len(ids)
        n_val = int(round(n * shares["validation"]))
        n_test = int(round(n * shares["test"]))
        if n >= 3:  # keep every non-empty share represented in small sets
            n_val = max(n_val, 1 if shares["validation"] > 0 else 0)
            n_test = max(n_test, 1 if shares["test"] > 0 else 0)
        n_val, n_test = min(n_val, n), min(n_test, max(0, n - n_val))
        for split, part in (("test", ids[:n_test]), ("validation", ids[n_test : n_test + n_val]), ("train", ids[n_test + n_val :])):
            out[split] += [rid for pid in part for rid in turns_of[pid]]
    return {s: sorted(v) for s, v in out.items()}


def check_split_sizes(df: pd.DataFrame, splits: dict[str, list[str]], fractions: dict[str, float],
                      holdout_set: str | None = None) -> None:
    """Refuse splits that the train and eval stages cannot use, before anything is written.

    Train and validation are needed by ``make train`` (fitting, then the fallback check), test by ``make eval``'s
    label and predictor methods; a split with a share > 0 must hold at least one request.

    Raises:
        ValueError: naming the empty splits, the prompts per source set, and what is needed (3 prompts per set
            with the default fractions).
    """
    wanted = [s for s in SPLITS if float(fractions.get(s, 0.0)) > 0 and not (holdout_set and s == "test")]
    if holdout_set:
        wanted.append("test")
    empty = [s for s in wanted if not splits[s]]
    if empty:
        per_set = df.assign(prompt=df["id"].map(prompt_id_of)).groupby("source_set")["prompt"].nunique().to_dict()
        raise ValueError(
            f"the {'/'.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty: {len(df)} requests from prompts per "
            f"set {per_set}, fractions {fractions}. Every split needs at least one prompt; a source set is split "
            "only from 3 prompts on (one each for train, validation, test). Label at least 3 prompts per set "
            "(data.limit=3 or more; 20+ per set for a predictor worth deploying), or change dataset.fractions.")


# -- features -----------------------------------------------------------------------------------------
def _hf_features(featurizer: Featurizer, num_candidates: int):
    from datasets import Features, List, Value

    spec = featurizer.spec
    cols = {
        "id": Value("string"), "source_set": Value("string"), "prompt_tokens": Value("int32"),
        "x": List(Value("float32"), length=featurizer.dim),
        "tau": List(Value("float32"), length=num_candidates), "tokens_per_s": List(Value("float32"), length=num_candidates),
        "label_tau": Value("int32"), "label_speed": Value("int32"), "label_tau_idx": Value("int32"),
        "label_speed_idx": Value("int32"), "entropy": Value("float32"),
    }
    if featurizer.uses_ids:
        cols["ids"] = List(Value("int64"), length=spec.k)
        cols["id_weights"] = List(Value("float32"), length=spec.k)
    return Features(cols)


def featurize_labels(df: pd.DataFrame, featurizer: Featurizer, candidates: list[int], chunk: int = 256) -> dict[str, np.ndarray]:
    """Columns of the feature dataset for label rows ``df`` (see the module docstring).

    Raises:
        ValueError: when a row's tau/tokens_per_s length differs from the candidates, or a label is not a candidate.
    """
    C = len(candidates)
    for col in ("tau", "tokens_per_s"):
        bad = df[df[col].map(len) != C]
        if len(bad):
            raise ValueError(f"label row {bad['id'].iloc[0]!r} has {len(bad[col].iloc[0])} {col} values for {C} candidates")
    for col in ("label_tau", "label_speed"):
        bad = df[~df[col].isin(candidates)]
        if len(bad):
            raise ValueError(f"label row {bad['id'].iloc[0]!r}: {col}={bad[col].iloc[0]} is not one of the candidates {candidates}")
    parts: dict[str, list[np.ndarray]] = {}
    for start in tqdm(range(0, len(df), chunk), desc="features", unit="chunk", disable=len(df) <= chunk):
        for name, value in featurizer.from_labels(df.iloc[start : start + chunk]).items():
            parts.setdefault(name, []).append(value)
    cols = {name: np.concatenate(v) for name, v in parts.items()} if parts else {"x": np.zeros((0, featurizer.dim), np.float32)}
    index = {b: i for i, b in enumerate(candidates)}
    cols.update({
        "id": df["id"].astype(str).to_numpy(), "source_set": df["source_set"].astype(str).to_numpy(),
        "prompt_tokens": df["prompt_tokens"].to_numpy(np.int32),
        "tau": np.array([np.asarray(v, np.float32) for v in df["tau"]]).reshape(-1, C),
        "tokens_per_s": np.array([np.asarray(v, np.float32) for v in df["tokens_per_s"]]).reshape(-1, C),
        "label_tau": df["label_tau"].to_numpy(np.int32), "label_speed": df["label_speed"].to_numpy(np.int32),
        "label_tau_idx": df["label_tau"].map(index).to_numpy(np.int32),
        "label_speed_idx": df["label_speed"].map(index).to_numpy(np.int32),
        "entropy": df["entropy"].to_numpy(np.float32),
    })
    return cols


def build_dataset(cfg: DictConfig) -> Path:
    """Run the dataset stage (see the module docstring); returns the DatasetDict directory.

    Raises:
        FileNotFoundError: without labels (run the label stage).
        ValueError: for labels that do not fit the features config (e.g. ``features.k`` > ``label.topk``).
    """
    from datasets import Dataset, DatasetDict

    dcfg = cfg.dataset
    df, meta = read_label_table(dcfg.labels_dir)
    check_label_template_kwargs(meta, cfg.get("model"), str(dcfg.labels_dir))
    candidates = label_candidates(df, meta)
    vocab = sorted(df["vocab_size"].astype(int).unique())
    if len(vocab) != 1:
        raise ValueError(f"label rows disagree on vocab_size {vocab}: labels of different targets in {dcfg.labels_dir}")
    spec = FeatureSpec.from_dict(OmegaConf.to_container(cfg.features, resolve=True))
    spec.vocab_size = int(vocab[0])
    featurizer = Featurizer(spec)
    splits = split_ids(df, int(dcfg.seed), dict(dcfg.fractions), dcfg.get("holdout_set"))
    check_split_sizes(df, splits, dict(dcfg.fractions), dcfg.get("holdout_set"))
    cols = featurize_labels(df, featurizer, candidates)
    features = _hf_features(featurizer, len(candidates))
    position = {pid: i for i, pid in enumerate(cols["id"])}
    dd = DatasetDict()
    for split in SPLITS:
        rows = np.array([position[i] for i in splits[split]], dtype=np.int64)
        dd[split] = Dataset.from_dict({name: cols[name][rows] for name in features}, features=features)
    out = Path(dcfg.out)
    info = {
        "features": spec.to_dict(), "candidates": candidates,
        "training_block_size": meta.get("training_block_size"), "target": meta.get("target"), "drafter": meta.get("drafter"),
        "labels_dir": str(dcfg.labels_dir), "label_meta": meta, "seed": int(dcfg.seed),
        "fractions": dict(dcfg.fractions), "holdout_set": dcfg.get("holdout_set"),
        "counts": {s: {str(k): int(v) for k, v in pd.Series(dd[s]["source_set"]).value_counts().sort_index().items()} for s in SPLITS},
    }
    save_dataset(dd, info, out)
    log.info("features %s (dim %d) for %d prompts -> %s: %s", spec.name, featurizer.dim, len(df), out,
             {s: len(dd[s]) for s in SPLITS})
    return out


def save_dataset(dd, info: dict, out: Path) -> None:
    """``save_to_disk`` into a temp dir beside ``out``, add ``blockpilot.json``, then rename into place."""
    with atomic_dir(out) as tmp:
        dd.save_to_disk(str(tmp))
        (tmp / INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")


def load_feature_dataset(directory: str | Path):
    """The dataset stage's output: ``(DatasetDict, info dict from blockpilot.json)``.

    Raises:
        FileNotFoundError: when ``directory`` holds no feature dataset (run the dataset stage).
    """
    from datasets import load_from_disk

    directory = Path(directory)
    if not (directory / INFO).exists():
        raise FileNotFoundError(f"no feature dataset at {directory}; run the dataset stage first: "
                                "make dataset (python -m pipeline.dataset run_name=<run> features=<name>)")
    return load_from_disk(str(directory)), json.loads((directory / INFO).read_text())


def split_prompt_ids(directory: str | Path) -> dict[str, list[str]]:
    """``{split: request ids}`` of a feature dataset (the eval stage maps them to prompts with ``prompt_id_of``)."""
    dd, _ = load_feature_dataset(directory)
    return {s: list(dd[s]["id"]) for s in dd}
