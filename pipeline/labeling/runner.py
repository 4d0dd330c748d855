"""The label stage's loop: prompts of this shard -> one label row per request, appended to the label store.

A request is one turn of a prompt (``pipeline.prompts.request_id``: the prompt id for the first turn,
``<id>#turn2`` for the second, ...). With ``label.turns=all`` (default) turn k is labelled on the
conversation a serving engine would see: the earlier user turns and the target's own replies to them
(the first seed's reply at T>0, identical whatever B). ``label.turns=first`` labels first turns only.

Sharding: prompt i of the configured sets (deterministic order) belongs to shard ``i % num_shards``.
``label.shard``/``label.num_shards`` come from Hydra (multirun, joblib or SLURM launchers); under
``torchrun`` each rank further splits its shard (effective shard ``shard * WORLD_SIZE + RANK`` of
``num_shards * WORLD_SIZE``) and uses GPU ``LOCAL_RANK``. All workers append to the same directory;
``read_labels`` merges them. A rerun skips prompts already stored, so a killed run resumes.

A request that does not fit the target's context (prompt + ``decode.max_new_tokens``) is skipped with a warning
naming it, together with the later turns of its prompt (they are longer still), and recorded in the label
directory's ``skipped.jsonl`` (``LabelStore.record_skipped``) and in the summary's ``skipped``; the other prompts are
labelled as usual.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Callable, Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from pipeline import costs
from pipeline.timing.steps import load_or_measure
from pipeline.decoding.requests import DecodeConfig
from pipeline.decoding.speculative import PromptTooLongError, SpeculativeDecoder
from pipeline.decoding.trees import TOP_K as TREE_TOP_K
from pipeline.labeling.checks import check_label_config
from pipeline.labeling.oracle import LabelSettings, check_candidates, label_prompt
from pipeline.labeling.store import LabelStore
from pipeline.decoding.build import build_decoder
from pipeline.prompts import Prompt, chat_input_ids, load_prompt_sets, request_id, set_chat_template_kwargs, template_kwargs_of
from pipeline.tracking import init_wandb

log = logging.getLogger(__name__)


def effective_shard(shard: int, num_shards: int, env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(shard, num_shards) after splitting a Hydra shard across torchrun ranks (RANK / WORLD_SIZE).

    Raises:
        ValueError: unless 0 <= shard < num_shards and 0 <= RANK < WORLD_SIZE.
    """
    shard, num_shards = int(shard), int(num_shards)
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= label.shard < label.num_shards, got shard {shard} of {num_shards}")
    world, rank = int(env.get("WORLD_SIZE", 1)), int(env.get("RANK", 0))
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad torchrun environment RANK={rank} WORLD_SIZE={world}")
    return shard * world + rank, num_shards * world


def shard_prompts(prompts: list[Prompt], shard: int, num_shards: int) -> list[Prompt]:
    """Prompt i goes to shard ``i % num_shards`` (order kept).

    Raises:
        ValueError: for duplicate prompt ids (labels are keyed by id).
    """
    counts = Counter(p.id for p in prompts)
    duplicates = [i for i, c in counts.items() if c > 1]
    if duplicates:
        raise ValueError(f"prompt ids must be unique across the configured sets; duplicated: {duplicates[:5]}")
    return [p for i, p in enumerate(prompts) if i % num_shards == shard]


def label_turns(prompt: Prompt, all_turns: bool = True) -> list[int]:
    """The 0-based turns of ``prompt`` that get a label row: every turn (``label.turns=all``) or the first."""
    return list(range(len(prompt.turns))) if all_turns else [0]


def settings_from_cfg(cfg: DictConfig, decoder: SpeculativeDecoder) -> LabelSettings:
    """``LabelSettings`` from the ``label`` and ``decode`` groups (candidates checked against the decoder)."""
    return LabelSettings(
        candidates=check_candidates(list(cfg.label.block_sizes), decoder),
        mode=str(cfg.label.mode),
        max_new_tokens=int(cfg.decode.max_new_tokens),
        temperature=float(cfg.decode.temperature),
        seed=int(cfg.decode.seed),
        repeats=int(cfg.label.repeats),
        topk=int(cfg.label.topk),
        store_full_logits=bool(cfg.label.store_full_logits),
        lm_head=str(cfg.label.lm_head),
        record_confidence=bool(cfg.label.get("record_confidence", True)),
        tree_top_k=int(cfg.label.get("tree_top_k", TREE_TOP_K)),
    )


def run_meta(cfg: DictConfig, settings: LabelSettings, decoder: SpeculativeDecoder) -> dict:
    """The ``meta.json`` of this run (without the latency model)."""
    drafter = decoder.drafter
    return {
        "target": str(cfg.model.target),
        "drafter": str(cfg.model.drafter) if cfg.model.get("drafter") else None,
        "training_block_size": int(drafter.block_size) if drafter is not None else None,
        "candidates": list(settings.candidates),
        "temperature": settings.temperature,
        "repeats": len(settings.seeds),
        "seed": settings.seed,
        "max_new_tokens": settings.max_new_tokens,
        "mode": settings.mode,
        "topk": settings.topk,
        "store_full_logits": settings.store_full_logits,
        "latency_model": None,
        "sets": [str(s["name"]) for s in cfg.data.sets],
        "chat_template_kwargs": template_kwargs_of(cfg.model),
    }


def run_label(cfg: DictConfig, decoder: SpeculativeDecoder | None = None,
              on_prompt: Callable[[dict], None] | None = None) -> dict:
    """Label this worker's prompts into ``cfg.label.out_dir``, one row per request (resumes; skips requests already stored).

    Args:
        cfg: the composed ``conf/label.yaml``.
        decoder: reuse a loaded decoder (tests); default: ``build_decoder(cfg.model)``.
        on_prompt: called with each finished request's row (after it is queued for writing); an exception raised
            there stops the run like a kill would, after the queued rows are written.
    Returns:
        {"out_dir", "shard", "num_shards", "labelled" (requests, this call), "already_done" (requests already stored),
        "skipped" (``[{"id", "reason"}]``: requests that do not fit the target's context), "label_tau" (counts of this
        call's labels)}.
    Raises:
        ValueError: for a bad config (``check_label_config``, before the model loads).
        FileNotFoundError: for a prompt set that cannot be read (``pipeline.prompts.PromptSetUnavailable``, naming the
            fix; also before the model loads).
    """
    check_label_config(cfg)
    turns_mode = str(cfg.label.get("turns", "all"))
    torch.manual_seed(int(cfg.seed))
    if cfg.label.get("num_threads"):
        torch.set_num_threads(int(cfg.label.num_threads))
    shard, num_shards = effective_shard(cfg.label.shard, cfg.label.num_shards)
    prompts = load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed, cfg.data.get("offset", 0),
                               str(cfg.data.get("missing", "error")),  # a missing set fails before the model loads
                               cfg.data.get("skipped_to"))
    prompts = shard_prompts(prompts, shard, num_shards)
    if decoder is None:
        model_cfg = cfg.model
        if int(os.environ.get("WORLD_SIZE", 1)) > 1 and str(model_cfg.device) == "cuda":
            model_cfg = OmegaConf.merge(model_cfg, {"device": f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"})
        decoder = build_decoder(model_cfg)
    set_chat_template_kwargs(decoder.target.tokenizer, template_kwargs_of(cfg.model))  # as recorded in meta.json
    settings = settings_from_cfg(cfg, decoder)

    store = LabelStore(cfg.label.out_dir)
    meta = run_meta(cfg, settings, decoder)
    latency = None
    if settings.mode == "replay":  # the run's stored model, else label.latency.path, else this machine's (cached)
        stored = store.read_meta() or {}
        latency = load_or_measure(decoder, cfg, settings.candidates, "label.latency", stored.get("latency_model"))
        meta["latency_model"] = latency.to_dict()
    meta = store.ensure_meta(meta)
    if settings.mode == "replay":
        latency = costs.CostModel.from_dict(meta["latency_model"])  # the first worker's model, for all workers

    done = store.done_ids(set_aside_bad=True)  # a truncated or garbled shard is moved aside and relabelled
    all_turns = turns_mode == "all"
    requests = {p.id: label_turns(p, all_turns) for p in prompts}
    todo = [p for p in prompts if any(request_id(p.id, t) not in done for t in requests[p.id])]
    total = sum(len(t) for t in requests.values())
    pending = sum(request_id(p.id, t) not in done for p in todo for t in requests[p.id])
    log.info("shard %d/%d: %d prompts (%d requests, turns=%s), %d requests already labelled, %d to do -> %s",
             shard, num_shards, len(prompts), total, turns_mode, total - pending, pending,
             store.directory)
    tokenizer = decoder.target.tokenizer
    if todo and cfg.label.get("warmup", True):
        for prompt in todo:  # the first prompt that fits the context
            try:
                decoder.generate(chat_input_ids(tokenizer, prompt.turns[:1]), max(settings.candidates),
                                 DecodeConfig(min(8, settings.max_new_tokens), settings.temperature, settings.seed))
                break
            except PromptTooLongError:
                continue
    run = init_wandb(cfg, job_type="label")
    flush_every = max(1, int(cfg.label.flush_every))
    queued: list[dict] = []
    labels: Counter = Counter()
    skipped: list[dict] = []
    try:
        progress = tqdm(total=total, initial=total - pending, desc=f"label {shard}/{num_shards}", unit="request")
        for prompt in todo:
            replies: list[str] = []
            turns = requests[prompt.id]
            for position, turn in enumerate(turns):
                rid = request_id(prompt.id, turn)
                input_ids = chat_input_ids(tokenizer, prompt.turns, replies)
                try:
                    if rid in done:  # labelled by an earlier run: only its reply is needed, for the next turn
                        if turn < turns[-1]:
                            reply_ids = decoder.generate(input_ids, 1, settings.decode_config(settings.seed)).output_ids
                            replies.append(tokenizer.decode(reply_ids, skip_special_tokens=True))
                        continue
                    result = label_prompt(decoder, input_ids, settings, latency)
                except PromptTooLongError as err:
                    later = [request_id(prompt.id, t) for t in turns[position:] if request_id(prompt.id, t) not in done]
                    log.warning("skipping request(s) %s: %s", later, err)
                    entries = [{"id": r, "reason": str(err)} for r in later]
                    store.record_skipped(entries)
                    skipped += entries
                    progress.update(len(later))
                    break
                replies.append(tokenizer.decode(result.reply_ids, skip_special_tokens=True))
                # the target's reply kept too: the other splits' suffix cache seed (policy.mixed.cache_seed=labels)
                row = {"id": rid, "source_set": prompt.source_set, "shard": shard, "num_shards": num_shards,
                       **result.row, "reply_ids": [int(t) for t in result.reply_ids]}
                queued.append(row)
                labels[row["label_tau"]] += 1
                progress.update(1)
                if run is not None:
                    run.log({"requests": sum(labels.values()), "label_tau": row["label_tau"],
                             "label_speed": row["label_speed"], "entropy": row["entropy"], "best_tau": max(row["tau"])})
                if on_prompt is not None:
                    on_prompt(row)
                if len(queued) >= flush_every:
                    store.write(queued)
                    queued = []
        progress.close()
    finally:
        store.write(queued)
        if run is not None:
            run.summary.update({"labelled": sum(labels.values()), **{f"label_tau/{b}": c for b, c in labels.items()}})
            run.finish()
    return {"out_dir": str(store.directory), "shard": shard, "num_shards": num_shards,
            "labelled": sum(labels.values()), "already_done": total - pending, "skipped": skipped,
            "label_tau": dict(labels)}
