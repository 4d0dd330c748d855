"""Training a DFlash drafter for a target and exporting it in the z-lab layout (the ``draft`` stage's library).

``train_drafter(cfg)`` runs the whole ``draft`` stage (``python -m pipeline.draft``, ``pipeline/draft.py``):
training prompt sets (``pipeline.drafting.sources``: local JSONL with ``turns``, hub ids, stdlib code prompts,
prompts the target writes itself: ``source: self``) -> target-generated responses, greedy or sampled per set
(``temperature``), with the tapped layers' features (cached shards, resumable) -> Lightning training
with random anchors, a block-sparse mask and a position-decayed loss (CE, optionally TV/KL to the
target; checkpointed every ``draft.checkpoint_every`` steps, resumed with ``draft.resume=true``) ->
``config.json`` + ``model.safetensors`` (bf16) + ``README.md`` model card (``pipeline.drafting.model_card``).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from pipeline import PROJECT_ROOT
from pipeline.drafting.corpus import build_corpus_cache
from pipeline.drafting.data import AnchorDataset, collate, load_sequences
from pipeline.drafting.model_card import hardware, write_model_card
from pipeline.drafting.checks import check_loss
from pipeline.drafting.module import DrafterModule, init_from_target_layers
from pipeline.drafting.responses import build_response_cache, generation_seconds
from pipeline.drafting.sources import training_prompts
from pipeline.files import atomic_dir
from pipeline.models.drafter import DFlashDrafter, make_drafter_config, num_parameters
from pipeline.models.loading import resolve_path as resolve_input
from pipeline.models.target import load_target
from pipeline.tracking import init_wandb

log = logging.getLogger(__name__)


class PrintProgress(L.Callback):
    """One log line every ``every_n_steps`` optimizer steps (readable in files, unlike a progress bar)."""

    def __init__(self, every_n_steps: int = 10):
        self.every_n_steps = every_n_steps
        self.t0 = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every_n_steps == 0:
            metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
            log.info("step %d  %.0f s  %s", step, time.time() - self.t0, metrics)


def frequent_tokens(sequences: list[dict], target, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of the training sequences (stop tokens always included), sorted."""
    vocab_size = target.model.config.vocab_size
    counts = torch.zeros(vocab_size)
    for seq in sequences:
        counts += torch.bincount(seq["tokens"], minlength=vocab_size)[:vocab_size].float()
    counts[target.stop_token_ids()] = float("inf")
    return counts.argsort(descending=True)[: min(size, vocab_size)].sort().values


def schedule_seconds(max_time: str | None) -> float | None:
    """``trainer.max_time`` ("DD:HH:MM:SS") in seconds, or None; the learning-rate decay spans it."""
    if not max_time:
        return None
    days, hours, minutes, seconds = (int(x) for x in str(max_time).split(":"))
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def train_drafter(cfg: DictConfig) -> Path:
    """Run the whole draft stage; returns the export directory."""
    L.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision(str(cfg.draft.get("float32_matmul_precision", "highest")))
    t_start = time.time()
    target = load_target(cfg.model.target, dtype=cfg.model.dtype, device=cfg.model.device)
    from pipeline.prompts import set_chat_template_kwargs, template_kwargs_of

    set_chat_template_kwargs(target.tokenizer, template_kwargs_of(cfg.model))  # the replies the drafter learns from
    dcfg = cfg.draft
    features_mode = dcfg.get("features", "cached")
    if features_mode not in ("cached", "online"):
        raise ValueError(f"draft.features={features_mode!r}: use 'cached' (features stored with the data) or 'online' "
                         "(token-only data; each training step runs the target)")
    with_features = features_mode == "cached"
    loss = check_loss(OmegaConf.to_container(dcfg.loss) if dcfg.get("loss") is not None else None)
    drafter_config = make_drafter_config(target.model.config, num_layers=dcfg.num_layers, block_size=dcfg.block_size,
                                         target_layer_ids=dcfg.get("target_layer_ids"), mask_token_id=dcfg.mask_token_id)
    layer_ids = drafter_config.dflash_config["target_layer_ids"]
    cache_root = Path(dcfg.cache_dir)
    dirs, data_seconds = [], {}
    for set_cfg in dcfg.sets:
        d = cache_root / set_cfg.name
        if set_cfg.source == "stdlib_source":  # teacher-forced text windows, no generation
            paths = build_corpus_cache(target, d, layer_ids, window=set_cfg.get("window", 384), limit=set_cfg.get("limit"),
                                       with_features=with_features)
        else:
            prompts = training_prompts(set_cfg, target, cfg)
            paths = build_response_cache(target, prompts, d, layer_ids, dcfg.max_new_tokens, dcfg.max_prompt_tokens,
                                         dcfg.gen_batch_size, set_cfg.get("max_batches"), with_features,
                                         temperature=float(set_cfg.get("temperature", 0.0)), seed=cfg.seed)
        seconds, unknown = generation_seconds(paths)
        data_seconds[set_cfg.name] = round(seconds) if not unknown else f"{round(seconds)} + {unknown} shards without a record"
        dirs.append(d)
    t_data = time.time()
    sequences = load_sequences(dirs, dcfg.max_seq_len, features=with_features)
    random.Random(cfg.seed).shuffle(sequences)
    n_val = max(1, int(len(sequences) * dcfg.val_fraction))
    val, train = sequences[:n_val], sequences[n_val:]
    response_tokens = sum(len(s["tokens"]) - s["prompt_length"] for s in sequences)
    log.info("%d sequences (%d response tokens); %d train / %d val", len(sequences), response_tokens, len(train), len(val))

    if dcfg.get("init_from"):  # continue training an exported drafter (same shape and draft vocabulary)
        drafter = DFlashDrafter.from_pretrained(resolve_input(dcfg.init_from)).train()
        if drafter.target_layer_ids != layer_ids or drafter.block_size != dcfg.block_size:
            raise ValueError(f"draft.init_from={dcfg.init_from} has taps {drafter.target_layer_ids} and B={drafter.block_size}; "
                             f"this config asks for {layer_ids} and B={dcfg.block_size}")
        if drafter.d2t is not None and drafter.draft_lm_head is None:  # an older folder: its head rows from the target
            drafter.set_draft_vocab(drafter.draft_vocab, target.model.get_output_embeddings().weight)
        copied = f"continued from {dcfg.init_from}"
    else:
        drafter = DFlashDrafter(drafter_config)
        if dcfg.get("draft_vocab_size"):
            drafter.set_draft_vocab(frequent_tokens(sequences, target, int(dcfg.draft_vocab_size)),
                                    target.model.get_output_embeddings().weight)
        copied = init_from_target_layers(drafter, target.model) if dcfg.init_from_target else []
    module = DrafterModule(drafter, target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight,
                           lr=dcfg.lr, weight_decay=dcfg.weight_decay, warmup_steps=dcfg.warmup_steps,
                           max_steps=dcfg.trainer.max_steps, gamma=dcfg.gamma, eval_block_sizes=tuple(dcfg.eval_block_sizes),
                           target_model=None if with_features else target.model,
                           max_seconds=schedule_seconds(dcfg.trainer.get("max_time")),
                           loss=loss)
    train_ds = AnchorDataset(train, dcfg.anchors_per_seq, cfg.seed)
    val_ds = AnchorDataset(val, dcfg.anchors_per_seq, cfg.seed + 1)
    workers = int(dcfg.get("num_workers", 0))
    train_dl = DataLoader(train_ds, batch_size=dcfg.batch_size, shuffle=True, collate_fn=collate, num_workers=workers,
                          persistent_workers=workers > 0)
    val_dl = DataLoader(val_ds, batch_size=dcfg.batch_size, collate_fn=collate, num_workers=workers)

    run = init_wandb(cfg, job_type="draft")
    loggers = []
    if run is not None:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(experiment=run))
    ckpt_dir = Path(cfg.paths.data) / "runs" / "draft" / cfg.run_name / "checkpoints"
    callbacks = [PrintProgress(every_n_steps=10)]
    every = int(dcfg.get("checkpoint_every") or 0)
    if every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step-{step}", every_n_train_steps=every,
                                         save_last=True, save_top_k=1, monitor="step", mode="max"))
    resume = ckpt_dir / "last.ckpt" if dcfg.get("resume") and (ckpt_dir / "last.ckpt").exists() else None
    if dcfg.get("resume"):
        log.info("resuming from %s" if resume else "draft.resume=true but no checkpoint in %s: starting fresh",
                 resume or ckpt_dir)
    trainer = L.Trainer(
        max_steps=dcfg.trainer.max_steps, max_time=dcfg.trainer.get("max_time"), val_check_interval=dcfg.trainer.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=dcfg.trainer.limit_val_batches, accelerator=dcfg.trainer.accelerator, devices=1,
        precision=dcfg.trainer.precision, gradient_clip_val=1.0, logger=loggers or False, enable_checkpointing=bool(every),
        default_root_dir=str(Path(cfg.paths.data) / "runs" / "draft"), log_every_n_steps=10, num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    t_train = time.time()
    trainer.fit(module, train_dl, val_dl, ckpt_path=str(resume) if resume else None)
    train_seconds = time.time() - t_train
    final = trainer.validate(module, val_dl, verbose=False)[0]
    val_tau = {str(drafter.block_size): final.get("val/tau", float("nan"))}
    val_tau.update({k.removeprefix("val/tau_b"): v for k, v in final.items() if k.startswith("val/tau_b")})
    val_tau_per_set = {k.removeprefix("val/tau/"): round(float(v), 4) for k, v in final.items() if k.startswith("val/tau/")}

    out = Path(dcfg.out) if Path(dcfg.out).is_absolute() else PROJECT_ROOT / dcfg.out
    with atomic_dir(out, mode=0o755) as tmp:
        drafter.save_pretrained(tmp, dtype=getattr(torch, dcfg.export_dtype))
        stats = {
            "target": cfg.model.target,
            "training block size": drafter.block_size,
            "draft layers": len(drafter.layers),
            "parameters": num_parameters(drafter),
            "draft vocabulary": int(drafter.d2t.numel()) if drafter.d2t is not None else "full",
            "initialised from target layers": copied or "random",
            "target layer taps": layer_ids,
            "training sequences per set": dict(Counter(s["set"] for s in sequences)),
            "training sequences (train/val)": f"{len(train)}/{len(val)}",
            "response tokens": response_tokens,
            "optimizer steps": trainer.global_step,
            "anchors per sequence x batch": f"{dcfg.anchors_per_seq} x {dcfg.batch_size}",
            "data generation wall time per set (s, recorded in the cached shards)": data_seconds,
            "this run's data stage wall time (s)": round(t_data - t_start),
            "training wall time (s)": round(train_seconds),
            "features": features_mode,
            "hardware": hardware(cfg.model.device),
            "loss": loss,
            "val_tau": val_tau,
            "val_tau_per_set": val_tau_per_set,
        }
        write_model_card(tmp, out.name, cfg, stats)
        (tmp / "training_stats.json").write_text(json.dumps(stats, indent=2, default=str))
    if run is not None:
        run.summary.update({f"val_tau_b{k}": v for k, v in val_tau.items()})
        run.finish()
    log.info("drafter written to %s (val tau %s)", out, val_tau)
    return out
