"""Fitting the block-size predictor on the feature dataset and exporting it for the decoder.

The library of the ``train`` stage (``python -m pipeline.train``, ``pipeline/train.py``), also run per fold by the
re-test (``pipeline.evaluation.retest``).

``train_predictor`` reads ``data/features/<run_name>/<features.name>/`` (``pipeline.policy.data``), trains a
``pipeline.policy.predictors`` net with ``pipeline.policy.module.PolicyModule`` (objective ``hard`` |
``soft`` | ``reward``; early stopping and best-checkpoint selection on ``val/expected_tau``), tunes
the confidence fallback to the training block size on the validation split (``train.fallback``, kept
only when its validation gain passes a bootstrap lower-bound check, ``train.fallback_confidence``; see
``pipeline.policy.fallback``), measures the per-request inference time and exports
``predictor.safetensors`` + ``predictor.json`` to ``data/predictors/<run_name>/<predictor.name>/``;
``export_verify_width_calibration`` fits and writes the verify-width policy's acceptance calibration.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from pipeline.policy.data import load_feature_dataset, read_label_table
from pipeline.policy.export import Predictor, export_predictor
from pipeline.policy.fallback import ALWAYS_FALLBACK, apply_fallback, departure_gain, tune_margin
from pipeline.policy.features import Featurizer, FeatureSpec
from pipeline.policy.module import PolicyModule, policy_metrics
from pipeline.policy.predictors import build_predictor, num_parameters
from pipeline.policy.schedule import measure_overhead_ms
from pipeline.tracking import init_wandb

log = logging.getLogger(__name__)

TARGETS = ("tau", "speed")


def split_tensors(ds, target: str = "tau") -> dict[str, torch.Tensor]:
    """Tensors of one split of the feature dataset.

    Returns:
        ``x`` [n, d], optional ``ids``/``id_weights`` [n, k], ``tau`` [n, C] (tokens), ``reward`` [n, C]
        (``tau``, or for ``target=speed`` tokens/s divided by the prompt's best), ``label`` [n] (class index).
    Raises:
        ValueError: for an unknown ``target``.
    """
    if target not in TARGETS:
        raise ValueError(f"train.target must be one of {TARGETS}, got {target!r}")
    cols = [c for c in ("x", "ids", "id_weights", "tau", "tokens_per_s", "label_tau_idx", "label_speed_idx") if c in ds.column_names]
    arrays = ds.with_format("numpy", columns=cols)[:]
    C = ds.features["tau"].length
    out = {"x": torch.from_numpy(np.asarray(arrays["x"], np.float32).reshape(len(ds), -1))}
    if "ids" in arrays:
        out["ids"] = torch.from_numpy(np.asarray(arrays["ids"], np.int64).reshape(len(ds), -1))
        out["id_weights"] = torch.from_numpy(np.asarray(arrays["id_weights"], np.float32).reshape(len(ds), -1))
    out["tau"] = torch.from_numpy(np.asarray(arrays["tau"], np.float32).reshape(len(ds), C))
    if target == "tau":
        out["reward"] = out["tau"]
        out["label"] = torch.from_numpy(np.asarray(arrays["label_tau_idx"], np.int64))
    else:
        speed = torch.from_numpy(np.asarray(arrays["tokens_per_s"], np.float32).reshape(len(ds), C))
        out["reward"] = speed / speed.max(-1, keepdim=True).values.clamp(min=1e-9)
        out["label"] = torch.from_numpy(np.asarray(arrays["label_speed_idx"], np.int64))
    return out


class TensorDict(Dataset):
    """Rows of a dict of equally long tensors, as dicts (default collate stacks them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.n = len(next(iter(tensors.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


def _predictor_kwargs(cfg: DictConfig, featurizer: Featurizer) -> dict:
    kwargs = OmegaConf.to_container(cfg.predictor, resolve=True)
    for key in ("name", "arch", "max_params"):
        kwargs.pop(key, None)
    if "id_buckets" in kwargs and not featurizer.uses_ids:
        kwargs["id_buckets"] = 0
    return kwargs


def train_predictor(cfg: DictConfig) -> Path:
    """Run the train stage (see the module docstring); returns the export directory.

    Raises:
        FileNotFoundError: without a feature dataset (run the dataset stage).
        ValueError: when the dataset was built with other features than ``features`` here, when a split
            is empty, or when the net exceeds ``predictor.max_params``.
    """
    tcfg = cfg.train
    L.seed_everything(int(cfg.seed), workers=True)
    dd, info = load_feature_dataset(tcfg.features_dir)
    spec = FeatureSpec.from_dict(info["features"])
    wanted = FeatureSpec.from_dict(OmegaConf.to_container(cfg.features, resolve=True))
    if not spec.same_features(wanted):
        raise ValueError(f"the dataset at {tcfg.features_dir} was built with features {spec.to_dict()}, not "
                         f"{wanted.to_dict()}; rerun make dataset with the same features config")
    featurizer = Featurizer(spec)
    candidates = [int(c) for c in info["candidates"]]
    for split in ("train", "validation"):
        if len(dd[split]) == 0:
            raise ValueError(f"the {split} split of {tcfg.features_dir} is empty; label more prompts or change dataset.fractions")
    data = {s: split_tensors(dd[s], tcfg.target) for s in dd}

    net = build_predictor(cfg.predictor.arch, featurizer.dim, len(candidates), **_predictor_kwargs(cfg, featurizer))
    n_params = num_parameters(net)
    cap = cfg.predictor.get("max_params")
    if cap is not None and n_params > int(cap):
        raise ValueError(f"predictor has {n_params} parameters, above predictor.max_params={cap}; lower predictor.hidden "
                         "or predictor.num_layers")
    net.fit_normalization(data["train"]["x"])
    module = PolicyModule(net, tcfg.objective, tcfg.temperature, tcfg.lr, tcfg.weight_decay)
    train_dl = DataLoader(TensorDict(data["train"]), batch_size=int(tcfg.batch_size), shuffle=True)
    val_dl = DataLoader(TensorDict(data["validation"]), batch_size=max(1, len(dd["validation"])))

    run = init_wandb(cfg, job_type=f"train-{cfg.predictor.name}")
    loggers = []
    if run is not None:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(experiment=run))
    tr = cfg.trainer
    monitor = "val/expected_tau"
    with tempfile.TemporaryDirectory(prefix="policy-ckpt-") as ckpt_dir:
        checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, monitor=monitor, mode="max", save_top_k=1,
                                                         save_weights_only=True)
        stopping = L.pytorch.callbacks.EarlyStopping(monitor=monitor, mode="max", patience=int(tr.patience))
        trainer = L.Trainer(max_epochs=int(tr.max_epochs), accelerator=tr.accelerator, devices=1, precision=tr.precision,
                            logger=loggers or False, callbacks=[checkpoint, stopping], enable_checkpointing=True,
                            enable_progress_bar=bool(tr.enable_progress_bar), enable_model_summary=False,
                            log_every_n_steps=int(tr.log_every_n_steps), num_sanity_val_steps=0,
                            default_root_dir=ckpt_dir)
        trainer.fit(module, train_dl, val_dl)
        best = torch.load(checkpoint.best_model_path, map_location="cpu", weights_only=False)["state_dict"]
        module.load_state_dict(best)
    net.eval().cpu()

    fixed_index = candidates.index(info["training_block_size"]) if info.get("training_block_size") in candidates else None
    best_fixed_index = int(data["train"]["tau"].mean(0).argmax())
    metrics: dict[str, dict] = {"epochs": trainer.current_epoch, "best_val_expected_tau": float(checkpoint.best_model_score)}
    with torch.no_grad():
        scores = {s: net(data[s]["x"], data[s].get("ids"), data[s].get("id_weights")) for s in dd if len(dd[s])}
    fallback = None
    if tcfg.get("fallback") and fixed_index is not None:
        # the deploy check judges departures by the label target's own reward: tau, or (target=speed) tokens/s relative
        # to the prompt's best, so a speed-labelled predictor is not held to tau, which it trades away on purpose
        reward = data["validation"]["reward"]
        unit = "tokens" if tcfg.target == "tau" else "of the best tokens/s"
        margin, val_reward = tune_margin(scores["validation"], reward, fixed_index)
        fallback = {"block_size": candidates[fixed_index], "margin": margin, "validation_pick_reward": val_reward,
                    "reward": str(tcfg.target)}
        confidence = tcfg.get("fallback_confidence")
        if confidence is not None and margin < ALWAYS_FALLBACK:
            check = departure_gain(scores["validation"], reward, fixed_index, margin, float(confidence),
                                   seed=int(cfg.seed))
            fallback.update({"tuned_margin": margin, "validation_gain": check})
            if check["lower_bound"] <= 0.0:
                fallback["margin"] = ALWAYS_FALLBACK
                fallback["validation_pick_reward"] = float(reward[:, fixed_index].mean())
                log.info("tuned margin %.4f departs on %d validation requests for a mean gain of %.5f %s, but its "
                         "%.0f%% lower bound is %.5f <= 0: always keeping B=%d", margin, check["departures"],
                         check["mean_gain"], unit, 100 * check["confidence"], check["lower_bound"], candidates[fixed_index])
        log.info("confidence fallback to B=%d: margin %.4f (validation pick %s %.4f)", candidates[fixed_index],
                 fallback["margin"], tcfg.target, fallback["validation_pick_reward"])
    for split, s in scores.items():
        d = data[split]
        pick = apply_fallback(s, fixed_index, fallback["margin"]) if fallback else None
        m = policy_metrics(s, d["tau"], d["label"], fixed_index, pick)
        m["best_fixed_tau"] = float(d["tau"][:, best_fixed_index].mean())
        if fallback:
            m["argmax_pick_tau"] = policy_metrics(s, d["tau"], d["label"], fixed_index)["pick_tau"]
        metrics[split] = m
    predictor = Predictor(net, featurizer, candidates, {"fallback": fallback})  # timed with the rule it exports
    overhead = measure_overhead_ms(predictor, tcfg.get("overhead_vocab_size") or spec.vocab_size, repeats=100)
    meta = {
        "name": str(cfg.predictor.name), "target": info.get("target"), "drafter": info.get("drafter"),
        "training_block_size": info.get("training_block_size"), "best_fixed_block_size": candidates[best_fixed_index],
        "target_label": str(tcfg.target), "objective": str(tcfg.objective), "temperature": float(tcfg.temperature),
        "features_dir": str(tcfg.features_dir), "metrics": metrics, "inference_ms": overhead,
        "seed": int(cfg.seed), "run_name": str(cfg.run_name),
    }
    if fallback:
        meta["fallback"] = fallback
    out = export_predictor(tcfg.out, net, spec, candidates, meta)
    if tcfg.get("calibration"):
        export_verify_width_calibration(tcfg.calibration, dd, info)
    log.info("%s predictor (%d params, %.3f ms/request) -> %s; test %s", cfg.predictor.name, n_params,
             overhead["median_ms"], out, metrics.get("test"))
    if run is not None:
        flat = {f"{split}/{k}": v for split, m in metrics.items() if isinstance(m, dict) for k, v in m.items()}
        run.summary.update({**flat, "num_parameters": n_params, "inference_ms": overhead["median_ms"]})
        run.finish()
    return out


def export_verify_width_calibration(ccfg: DictConfig, dd, info: dict) -> Path | None:
    """Fit the verify-width policy's acceptance calibration on the train split's label samples and export it.

    Reads the label rows of ``ccfg.labels_dir`` (their ``conf_*`` replay samples), fits on the requests of the
    feature dataset's train split (without the prompt sets of ``ccfg.exclude_sets``), with a model per candidate rank
    where the rows hold candidate records, tabulates reliability on its test split, writes ``ccfg.out/calibration.json``
    (``pipeline.policy.calibration``). Labels without samples are skipped with a warning (returns None).
    """
    from pipeline.policy.calibration import export_calibration, fit_from_labels

    try:
        labels, _ = read_label_table(ccfg.labels_dir)
        exclude = [str(s) for s in (ccfg.get("exclude_sets") or [])]
        fitted = fit_from_labels(labels, set(dd["train"]["id"]), set(dd["test"]["id"]) if "test" in dd else None,
                                 exclude_sets=exclude,
                                 info={"labels_dir": str(ccfg.labels_dir), "target": info.get("target"),
                                       "drafter": info.get("drafter"), **({"exclude_sets": exclude} if exclude else {})})
    except (FileNotFoundError, ValueError) as err:
        log.warning("no verify-width calibration exported: %s", err)
        return None
    path = export_calibration(ccfg.out, fitted)
    c = fitted["calibration"].info
    log.info("verify-width calibration (%d train samples, accept rate %.3f, test Brier %s) -> %s", c["samples"],
             c["accept_rate"], f"{c['test_brier']:.4f}" if "test_brier" in c else "-", path)
    return path
