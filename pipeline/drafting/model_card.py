"""The exported drafter's model card (``README.md``): data, steps, wall time, hardware, teacher-forced tau per B."""

from __future__ import annotations

import platform
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.models.export_drafter import with_loading_section


def hardware(device: str) -> str:
    """What trained the drafter: the GPU's name on CUDA, else the CPU and its thread count."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def write_model_card(out: Path, name: str, cfg: DictConfig, stats: dict) -> None:
    """A README.md in ``out`` for drafter ``name``: data, steps, wall time, teacher-forced tau per B."""
    lines = [
        f"# {name}",
        "",
        f"DFlash drafter for `{cfg.model.target}`, trained by the draft stage (pipeline/draft.py, "
        f"draft.features={cfg.draft.get('features', 'cached')}), seed {cfg.seed}.",
        "",
        "| item | value |", "|---|---|",
    ]
    for k, v in stats.items():
        if k not in ("val_tau", "val_tau_per_set"):
            lines.append(f"| {k} | {', '.join(f'{a}: {b}' for a, b in v.items()) if isinstance(v, dict) else v} |")
    lines += ["", "Teacher-forced acceptance length on held-out training-distribution sequences (not a benchmark):", "",
              "| B | tau |", "|---|---|"]
    for b, tau in sorted(stats.get("val_tau", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {b} | {tau:.3f} |")
    if stats.get("val_tau_per_set"):
        lines += ["", "The same at the training block size, per training set:", "", "| set | tau |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in sorted(stats["val_tau_per_set"].items())]
    lines += ["", "Config:", "", "```yaml", OmegaConf.to_yaml(cfg.draft), "```", ""]
    vocab = stats.get("draft vocabulary")
    (out / "README.md").write_text(with_loading_section("\n".join(lines), vocab if isinstance(vocab, int) else None))
