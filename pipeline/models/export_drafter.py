"""Re-export a drafter folder with the hub files, in vLLM's draft-vocabulary layout, optionally as a full-vocabulary
variant (``make export-drafter SRC=... DST=... [FULL_VOCAB=1] [TARGET=...]``; SRC may equal DST: in place).

``export_drafter`` writes DST with ``config.json`` (``auto_map`` set, ``dtype`` = the dtype the weights are stored in,
a draft vocabulary's size as the top-level ``draft_vocab_size``), ``modeling_dflash.py`` (the remote-code model,
``pipeline/models/hub/``), the weights and SRC's other files (model card, ``training_stats.json``,
``calibration.json``), and adds a "Loading" section to the model card (``README.md``).

A folder already in the current layout keeps its weights byte for byte. A folder of an older BlockPilot (absolute ids
in ``draft_vocab``) is rewritten into vLLM's layout (``pipeline.models.drafter.vllm_layout``: ``d2t`` offsets and the
target LM head's rows as ``lm_head.weight``, read from ``target``); its other tensors are unchanged. ``full_vocab``
drops the draft vocabulary (``d2t``, ``lm_head.weight``, ``draft_vocab_size``), for loaders that do not know it: the
drafter then scores the whole vocabulary, which it was not trained to do, so its drafts (and tau) differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.files import atomic_dir
from pipeline.models.drafter import CONFIG_NAME, HEAD_KEY, LEGACY_VOCAB_KEY, REMOTE_CODE_NAME, vllm_layout, write_config

LOADING_HEADING = "## Loading"


def loading_section(draft_vocab_size: int | None) -> str:
    """The model card's "Loading" section (markdown) for a folder with (``draft_vocab_size`` = N) or without one."""
    if draft_vocab_size:
        vocab = (f"The drafter has a draft vocabulary of {draft_vocab_size} tokens, an EAGLE-3-style reduced draft head "
                 "in vLLM's layout: the top-level `draft_vocab_size`, `d2t` (int64 offsets: draft row i proposes target "
                 "token i + d2t[i]) and `lm_head.weight` (the target LM head's rows of those tokens). It scores only "
                 "those rows and proposes only those tokens (verification is unchanged, so decoding stays lossless). "
                 "Loaders that do not know it (z-lab's `DFlashDraftModel`) drop `d2t` and `lm_head.weight` and score the "
                 "full vocabulary, so some of their drafts differ; `make export-drafter SRC=... DST=... FULL_VOCAB=1` "
                 "writes a copy without it.")
    else:
        vocab = "This folder scores the full vocabulary (no `d2t` / `lm_head.weight`)."
    return "\n".join([
        LOADING_HEADING,
        "",
        "z-lab DFlash layout (`config.json`, `model.safetensors`) plus `modeling_dflash.py` (named in `auto_map`). "
        "`config.json`'s `dtype` is the dtype the weights are stored in.",
        "",
        "```python",
        "# BlockPilot (casts to the dtype given, the target's)",
        "from pipeline.models.drafter import DFlashDrafter",
        "drafter = DFlashDrafter.from_pretrained(path, dtype=torch.float32)",
        "",
        "# remote code: the drafter of modeling_dflash.py, draft vocabulary included; casts its inputs to its own",
        "# dtype and returns the caller's, so a bfloat16 folder runs beside a float32 target",
        "from transformers import AutoModel",
        "draft = AutoModel.from_pretrained(path, trust_remote_code=True)",
        "output_ids = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256, stop_token_ids=[eos])",
        "# z-lab's decoding loop (greedy or sampling) also runs it, drafting from the draft vocabulary only:",
        "# dflash.model.dflash_generate(draft, target, input_ids, 256, [eos], temperature)",
        "",
        "# z-lab's class (pip install dflash): same tensors and forward; pass the target's dtype, since transformers 5",
        "# loads the stored dtype and its fc does not cast float32 target features",
        "from dflash import DFlashDraftModel",
        "draft = DFlashDraftModel.from_pretrained(path, dtype=target.dtype)",
        "```",
        "",
        "vLLM 0.32 serves the folder as it is (`--speculative-config '{\"method\": \"dflash\", \"model\": \"<path>\", "
        "\"num_speculative_tokens\": 7}'`; BlockPilot's plugin and launcher: docs/vllm.md).",
        "",
        "Without `trust_remote_code=True`, `AutoModel` builds a plain `Qwen3Model` from this config (wrong model). "
        + vocab,
        "",
    ])


def with_loading_section(card: str, draft_vocab_size: int | None) -> str:
    """``card`` with its "Loading" section replaced by (or, when it has none, followed by) ``loading_section``."""
    section = loading_section(draft_vocab_size)
    lines = card.splitlines()
    if LOADING_HEADING in lines:
        start = lines.index(LOADING_HEADING)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "\n".join(lines[end:])
        return "\n".join(lines[:start]) + "\n" + section + ("\n" + rest + "\n" if rest else "")
    return card.rstrip("\n") + "\n\n" + section


def _stored_dtype(weight_files: list[Path]) -> str | None:
    """The dtype of the first floating-point tensor (``bfloat16``, ``float32``...), or None."""
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
    for file in weight_files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype in names:
                    return names[dtype]
    return None


def _target_head(target: str | None):
    """The output-head weight [V, H] of ``target`` (a hub id, local folder or ``smollm2-135m-instruct``), or None."""
    if target is None:
        return None
    from pipeline.models.loading import resolve_path
    from pipeline.models.target import load_target

    name = str(target)
    model = load_target(resolve_path(name) if name != "smollm2-135m-instruct" else name).model
    return model.get_output_embeddings().weight


def export_drafter(src: str | Path, dst: str | Path, full_vocab: bool = False, target: str | None = None) -> Path:
    """Write drafter folder ``src`` to ``dst`` (may be the same folder) with the hub files; see the module docstring.

    Args:
        target: the drafter's target (hub id, folder or ``smollm2-135m-instruct``), read only when an older folder's
            draft vocabulary needs the head rows of vLLM's layout.
    Raises:
        FileNotFoundError: when ``src`` has no ``config.json`` or no ``*.safetensors``.
        FileExistsError: when ``dst`` is another non-empty folder that holds no drafter (it would be replaced).
        ValueError: when an older folder's draft vocabulary needs the target's head rows and ``target`` is None.
    """
    src, dst = Path(src), Path(dst)
    if not (src / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{src} has no {CONFIG_NAME}: pass a drafter folder (z-lab layout)")
    weight_files = sorted(src.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{src} has no *.safetensors weights")
    if dst.exists() and dst.resolve() != src.resolve() and any(dst.iterdir()) and not (dst / CONFIG_NAME).is_file():
        raise FileExistsError(f"{dst} exists and is not a drafter folder; pick another output folder")
    config = json.loads((src / CONFIG_NAME).read_text())
    rewritten: dict[str, dict] = {}  # weight file name -> (tensors, metadata), for files whose tensors change
    vocab_keys = {"d2t", HEAD_KEY, LEGACY_VOCAB_KEY}
    for file in weight_files:
        with safe_open(file, "pt") as f:
            keys, metadata = list(f.keys()), f.metadata()
            if (full_vocab and vocab_keys & set(keys)) or LEGACY_VOCAB_KEY in keys:
                rewritten[file.name] = {"tensors": {k: f.get_tensor(k) for k in keys}, "metadata": metadata}
    if full_vocab:
        config.pop("draft_vocab_size", None)
        config["dflash_config"] = {k: v for k, v in (config.get("dflash_config") or {}).items() if k != "draft_vocab_size"}
        for entry in rewritten.values():
            entry["tensors"] = {k: v for k, v in entry["tensors"].items() if k not in vocab_keys}
    elif rewritten:  # an older folder: its draft_vocab becomes d2t + lm_head.weight, in the file that held it
        holder = next(name for name, e in rewritten.items() if LEGACY_VOCAB_KEY in e["tensors"])
        state = {k: v for entry in rewritten.values() for k, v in entry["tensors"].items()}
        needs_head = HEAD_KEY not in state
        config, state = vllm_layout(config, state, _target_head(target) if needs_head else None)
        tensors = rewritten[holder]["tensors"]
        del tensors[LEGACY_VOCAB_KEY]
        tensors.update({"d2t": state["d2t"], HEAD_KEY: state[HEAD_KEY]})
    stored = _stored_dtype(weight_files)
    if stored:
        config["dtype"] = stored
        if "torch_dtype" in config:
            config["torch_dtype"] = stored

    with atomic_dir(dst, mode=0o755) as tmp:
        for file in sorted(src.iterdir()):
            if file.name in (CONFIG_NAME, REMOTE_CODE_NAME) or not file.is_file():
                continue
            if file.name in rewritten:
                entry = rewritten[file.name]
                save_file({k: v.contiguous() for k, v in entry["tensors"].items()}, tmp / file.name,
                          metadata=entry["metadata"])
                (tmp / file.name).chmod(0o644)
            else:
                shutil.copyfile(file, tmp / file.name)
        write_config(tmp, config)
        card = tmp / "README.md"
        if card.exists():
            card.write_text(with_loading_section(card.read_text(), config.get("draft_vocab_size")))
    return dst
