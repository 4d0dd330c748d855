"""Re-export a drafter folder with the hub files, optionally as a full-vocabulary variant.

``python -m pipeline.models.export_drafter SRC DST [--full-vocab]`` (SRC may equal DST: in place)

writes DST with ``config.json`` (``auto_map`` set, ``dtype`` = the dtype the weights are stored in),
``modeling_dflash.py`` (the remote-code model, ``pipeline/models/hub/``), the weights and SRC's other files
(model card, ``training_stats.json``), and adds a "Loading" section to the model card (``README.md``).

The weights are copied byte for byte. ``--full-vocab`` drops BlockPilot's ``draft_vocab`` tensor and
``dflash_config.draft_vocab_size``, for loaders that do not know the extension: the drafter then scores the whole
vocabulary, which it was not trained to do, so its drafts (and tau) differ from the draft-vocabulary drafter's;
the other tensors are unchanged.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.models.drafter import CONFIG_NAME, REMOTE_CODE_NAME, write_config

LOADING_HEADING = "## Loading"


def loading_section(draft_vocab_size: int | None) -> str:
    """The model card's "Loading" section (markdown) for a folder with (``draft_vocab_size`` = N) or without one."""
    if draft_vocab_size:
        vocab = (f"`draft_vocab` (int64 [{draft_vocab_size}] target token ids, `dflash_config.draft_vocab_size`) is a "
                 "BlockPilot extension of the z-lab layout, an EAGLE-3-style reduced draft head: the drafter scores "
                 f"only those {draft_vocab_size} rows of the target's LM head and proposes only those tokens "
                 "(verification is unchanged, so decoding stays lossless). Loaders that do not know it (z-lab's "
                 "`DFlashDraftModel`) drop it and score the full vocabulary, so some of their drafts differ; "
                 "`python -m pipeline.models.export_drafter SRC DST --full-vocab` writes a copy without it.")
    else:
        vocab = "This folder scores the full vocabulary (no `draft_vocab` tensor)."
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


def export_drafter(src: str | Path, dst: str | Path, full_vocab: bool = False) -> Path:
    """Write drafter folder ``src`` to ``dst`` (may be the same folder) with the hub files; see the module docstring.

    Raises:
        FileNotFoundError: when ``src`` has no ``config.json`` or no ``*.safetensors``.
        FileExistsError: when ``dst`` is another non-empty folder that holds no drafter (it would be replaced).
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
    dflash = dict(config.get("dflash_config") or {})
    if full_vocab:
        dflash.pop("draft_vocab_size", None)
    config["dflash_config"] = dflash
    stored = _stored_dtype(weight_files)
    if stored:
        config["dtype"] = stored
        if "torch_dtype" in config:
            config["torch_dtype"] = stored

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        tmp.chmod(0o755)
        for file in sorted(src.iterdir()):
            if file.name in (CONFIG_NAME, REMOTE_CODE_NAME) or not file.is_file():
                continue
            if file.suffix == ".safetensors" and full_vocab:
                with safe_open(file, "pt") as f:
                    metadata = f.metadata()
                    tensors = {k: f.get_tensor(k) for k in f.keys() if k != "draft_vocab"}
                save_file(tensors, tmp / file.name, metadata=metadata)
            else:
                shutil.copyfile(file, tmp / file.name)
        write_config(tmp, config)
        card = tmp / "README.md"
        if card.exists():
            card.write_text(with_loading_section(card.read_text(), dflash.get("draft_vocab_size")))
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dst


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m pipeline.models.export_drafter", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="drafter folder (z-lab layout)")
    parser.add_argument("dst", help="output folder (may be SRC: re-export in place)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="drop the draft_vocab extension (for loaders that do not know it)")
    args = parser.parse_args(argv)
    out = export_drafter(args.src, args.dst, full_vocab=args.full_vocab)
    print(f"drafter written to {out}")
    return out


if __name__ == "__main__":
    main()
