"""The DFlash block-diffusion drafter, reading and writing the z-lab checkpoint layout.

The model is ``pipeline/models/hub/modeling_dflash.py``'s ``DFlashDraftModel`` (z-lab/dflash ``dflash/model.py``
on transformers' Qwen3 blocks; DFlash, Chen et al. 2026): the hidden states of several target layers are
concatenated, projected (``fc``) and normalised (``hidden_norm``) into context features that every draft layer sees
as extra keys/values; the B positions of a block (the last verified token followed by B-1 mask tokens) attend to
each other non-causally; the target's input embedding and LM head are reused, so the drafter owns only its layers.
``DFlashDrafter`` is that class with BlockPilot's checkpoint reader and writer, so the drafter BlockPilot decodes,
labels and trains with is the one every exported folder ships.

Checkpoint layout (a public ``z-lab/Qwen3-4B-DFlash-b16`` loads unchanged; vLLM 0.32 loads our folders unchanged)::

    config.json        Qwen3 config + block_size, num_target_layers,
                       dflash_config.{target_layer_ids, mask_token_id}; dtype = the dtype the weights are stored in;
                       auto_map.AutoModel = modeling_dflash.DFlashDraftModel (written by ``save_pretrained``);
                       with a draft vocabulary, the top-level draft_vocab_size N (vLLM's key)
    model.safetensors  layers.*, fc.weight, hidden_norm.weight, norm.weight; with a draft vocabulary also d2t
                       (int64 [N] offsets: draft row i is target token i + d2t[i]) and lm_head.weight ([N, H], the
                       target LM head's rows of those tokens, in the head's own dtype, so that vLLM, which scores with
                       the drafter's own head, drafts what BlockPilot drafts)
    modeling_dflash.py the remote-code model (a copy of ``pipeline/models/hub/modeling_dflash.py``, torch +
                       transformers only), so ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` and z-lab's
                       ``dflash_generate`` load and run the folder, draft vocabulary included

Dtype: ``save_pretrained`` stores the weights in ``dtype`` (bfloat16 by default) and records it in ``config.json``.
``from_pretrained`` casts them to the dtype it is given (the target's: ``model.dtype``); the remote-code model casts
its inputs to its own dtype and returns the caller's, so a bfloat16 folder also runs beside a float32 target there.
z-lab's own ``dflash.DFlashDraftModel`` does not cast: under transformers 5 it loads such a folder in bfloat16
(``dtype="auto"``) and fails in ``fc`` on float32 target features; pass it ``dtype=`` the target's dtype.

Attention layers follow the config's ``layer_types`` as z-lab's code does: a ``sliding_attention`` layer is causal
(unless the config sets ``is_causal``) and sees only keys within ``sliding_window`` positions of the query; a
``full_attention`` layer (the default) sees every key, non-causally.

Optional draft vocabulary (absent from z-lab checkpoints, which then use the full vocabulary), as in EAGLE-3's
reduced draft head and in vLLM's layout of it (above): the drafter scores only N rows of the target's LM head (49152 ->
8192 rows for SmolLM2: ~6x less LM-head work per draft and per training step) and can only propose those tokens;
verification is unchanged, so decoding stays lossless. BlockPilot scores with the target's head rows at
``draft_vocab`` (bit-equal to ``lm_head.weight`` when the target's dtype is the stored one). Loaders that do not know
it (z-lab's ``DFlashDraftModel``) drop ``d2t`` and ``lm_head.weight`` and score the full vocabulary, so their drafts
differ; ``make export-drafter FULL_VOCAB=1`` writes a copy without it. ``from_pretrained`` also reads folders of older
BlockPilot versions (``dflash_config.draft_vocab_size`` + an absolute-id tensor ``draft_vocab``, no ``lm_head.weight``);
``pipeline.models.export_drafter`` rewrites them in this layout.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, Qwen3Config

from pipeline.models.backend import LMHead
from pipeline.models.hub.modeling_dflash import DFlashDraftModel, draft_vocab_size

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
REMOTE_CODE_NAME = "modeling_dflash.py"
REMOTE_CODE = Path(__file__).parent / "hub" / REMOTE_CODE_NAME  # package data (pyproject.toml)
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
HEAD_KEY = "lm_head.weight"  # the draft vocabulary's LM-head rows (vLLM's own drafter head)
LEGACY_VOCAB_KEY = "draft_vocab"  # absolute ids of older BlockPilot folders


def draft_offsets(token_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's ``d2t`` of a draft vocabulary: int64 offsets ``token_ids - arange(N)`` (draft row i is target token
    i + d2t[i]). Raises ``ValueError`` for ids that are not a 1-D integer tensor."""
    if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
        raise ValueError(f"a draft vocabulary is a 1-D tensor of integer token ids, got {tuple(token_ids.shape)} "
                         f"{token_ids.dtype}")
    token_ids = token_ids.to(torch.long)
    return token_ids - torch.arange(token_ids.numel(), dtype=torch.long, device=token_ids.device)


def vllm_layout(config: dict, state: dict[str, torch.Tensor], lm_head: torch.Tensor | None = None
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A drafter folder's (config, tensors) in vLLM's draft-vocabulary layout, from either layout.

    Older folders (``dflash_config.draft_vocab_size`` + absolute ids ``draft_vocab``) get the top-level
    ``draft_vocab_size``, ``d2t`` (``draft_offsets``) and ``lm_head.weight`` = ``lm_head[draft_vocab]`` (the target's
    output head [V, H], in its own dtype); folders already in it, and full-vocabulary folders, come back unchanged.

    Raises:
        ValueError: when an older folder needs its head rows and ``lm_head`` is None (names the option), or when
            ``lm_head`` does not cover the draft vocabulary.
    """
    config = dict(config)
    state = dict(state)
    dflash = dict(config.get("dflash_config") or {})
    legacy = state.pop(LEGACY_VOCAB_KEY, None)
    if legacy is not None:
        state["d2t"] = draft_offsets(legacy)
    n = draft_vocab_size(_Namespace(config, dflash))
    dflash.pop("draft_vocab_size", None)
    config["dflash_config"] = dflash
    if not n:
        config.pop("draft_vocab_size", None)
        return config, state
    config["draft_vocab_size"] = int(n)
    if "d2t" not in state:
        raise ValueError(f"the config sets draft_vocab_size={n} but the weights hold neither d2t nor draft_vocab")
    if HEAD_KEY not in state:
        if lm_head is None:
            raise ValueError("this drafter folder has no lm_head.weight (the draft vocabulary's LM-head rows vLLM scores "
                             "with): pass the target (make export-drafter TARGET=<target>) so its head rows are written")
        ids = state["d2t"] + torch.arange(int(n), dtype=torch.long)
        if int(ids.max()) >= lm_head.shape[0] or int(ids.min()) < 0:
            raise ValueError(f"the draft vocabulary holds ids outside the target's {lm_head.shape[0]}-token LM head")
        state[HEAD_KEY] = lm_head.detach()[ids].clone().contiguous()
    return config, state


class _Namespace:
    """A config dict read like a ``PretrainedConfig`` (for ``draft_vocab_size``)."""

    def __init__(self, config: dict, dflash: dict):
        self.draft_vocab_size = config.get("draft_vocab_size")
        self.dflash_config = dflash
        self.vocab_size = config.get("vocab_size", -1)


def write_config(directory: str | Path, config: dict) -> Path:
    """Write ``config`` as ``config.json`` with ``auto_map`` set, and copy ``modeling_dflash.py`` beside it.

    The pair makes ``AutoModel.from_pretrained(directory, trust_remote_code=True)`` build the DFlash drafter (with
    its draft vocabulary) instead of a plain ``Qwen3Model``. transformers 5 writes the rotary settings only as
    ``rope_parameters``; ``rope_theta`` (and ``rope_scaling`` for a non-default rotary type) are written beside
    it so that transformers 4.x readers (z-lab's ``dflash`` on older installs) get the same rotary embedding.
    Returns the path of ``config.json``.
    """
    directory = Path(directory)
    config = {**config, "auto_map": dict(AUTO_MAP)}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    path = directory / CONFIG_NAME
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(REMOTE_CODE, directory / REMOTE_CODE_NAME)
    return path


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """Evenly spaced target layers from layer 1 to ``num_target_layers - 3`` (z-lab's spacing).

    Example: 36 layers, 5 taps -> [1, 9, 17, 25, 33]; 30 layers -> [1, 8, 14, 20, 27].
    """
    start, end = 1, max(1, num_target_layers - 3)
    if num_taps == 1:
        return [(start + end) // 2]
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


def make_drafter_config(
    target_config: PretrainedConfig,
    num_layers: int = 3,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int = 0,
    intermediate_size: int | None = None,
) -> Qwen3Config:
    """A drafter config matched to a target: same hidden size, heads, vocab and RoPE.

    Args:
        target_config: the target's config (Llama, Qwen3, ...).
        num_layers: draft layers.
        block_size: the training block size B (tokens per block, the anchor included).
        target_layer_ids: which target layers feed the context features (0-based decoder layers).
        mask_token_id: the token id placed at the B-1 positions to be drafted.
    """
    tc = target_config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    ids = target_layer_ids if target_layer_ids is not None else default_target_layer_ids(tc.num_hidden_layers)
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=getattr(tc, "rms_norm_eps", None) or getattr(tc, "layer_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = int(block_size)
    config.num_target_layers = int(tc.num_hidden_layers)
    config.dflash_config = {"target_layer_ids": [int(i) for i in ids], "mask_token_id": int(mask_token_id)}
    return config


class DFlashDrafter(DFlashDraftModel):
    """BlockPilot's DFlash drafter: the remote-code ``DFlashDraftModel`` itself (its layers, forward, fast path and
    scoring; ``pipeline/models/hub/modeling_dflash.py``), plus the z-lab checkpoint reader and writer and the
    draft-vocabulary setter.

    Attributes:
        config: the z-lab-layout ``Qwen3Config`` (``block_size``, ``dflash_config``...).
        block_size: training block size B.
        target_layer_ids: target decoder layers whose outputs form the context features.
        mask_token_id: token id at the positions to be drafted.
    """

    draft_lm_head: torch.Tensor | None = None  # [N, H] the target head's rows of the draft vocabulary (lm_head.weight)

    def set_draft_vocab(self, token_ids: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Restrict proposals to ``token_ids`` [N] (target vocabulary ids): stores ``d2t`` (``draft_offsets``), records
        N as the config's top-level ``draft_vocab_size``, and keeps ``lm_head[token_ids]`` (the target's output head
        [V, H]; needed by ``save_pretrained``, since vLLM scores with the drafter's own head rows)."""
        token_ids = token_ids.to(torch.long).flatten()
        d2t = draft_offsets(token_ids)
        self.config.draft_vocab_size = int(token_ids.numel())
        self.config.dflash_config = {k: v for k, v in self.config.dflash_config.items() if k != "draft_vocab_size"}
        if self.d2t is None:
            del self.d2t
            self.register_buffer("d2t", d2t)
        else:
            self.d2t = d2t.to(self.d2t.device)
        self.draft_lm_head = None if lm_head is None else lm_head.detach()[token_ids.to(lm_head.device)].clone()

    # ----------------------------------------------------------------------------------------
    # z-lab checkpoint layout
    # ----------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write ``config.json``, ``model.safetensors`` (z-lab layout, weights in ``dtype``, recorded as the config's
        ``dtype``; a draft vocabulary's ``d2t`` as int64 and its ``lm_head.weight`` rows in their own dtype) and the
        remote-code ``modeling_dflash.py`` into ``directory``.

        Raises:
            ValueError: for a draft vocabulary without its LM-head rows (``set_draft_vocab(ids, lm_head=...)``).
        """
        directory = Path(directory)
        state = {k: (v.detach() if k == "d2t" else v.detach().to(dtype)).contiguous()
                 for k, v in self.state_dict().items() if "rotary_emb" not in k}
        if self.d2t is not None:
            if self.draft_lm_head is None:
                raise ValueError("a drafter with a draft vocabulary writes its LM-head rows (lm_head.weight, what vLLM "
                                 "scores with): set them with set_draft_vocab(token_ids, lm_head=<the target's output "
                                 "head weight>)")
            state[HEAD_KEY] = self.draft_lm_head.detach().cpu().contiguous()
        directory.mkdir(parents=True, exist_ok=True)
        save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})
        config = self.config.to_dict()
        config["dflash_config"] = {k: v for k, v in (config.get("dflash_config") or {}).items() if k != "draft_vocab_size"}
        config.pop("draft_vocab_size", None)
        if self.d2t is not None:
            config["draft_vocab_size"] = int(self.d2t.numel())
        config["dtype"] = str(dtype).removeprefix("torch.")
        write_config(directory, config)
        return directory

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "DFlashDrafter":
        """Load a drafter from a local directory or a hub id (z-lab layout).

        Raises:
            FileNotFoundError: when neither a local directory nor a reachable hub id.
            ValueError: when the checkpoint's weights do not match its config (names the tensors; for ``fc.weight``
                the number of taps the weights were made for).
        """
        directory = Path(name_or_path)
        if not directory.is_dir():
            try:
                from huggingface_hub import snapshot_download

                directory = Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))
            except Exception as err:  # offline, unknown id, ...
                raise FileNotFoundError(
                    f"drafter {name_or_path!r} is neither a local directory nor a reachable hub id ({err}); "
                    "pass a local path (model.drafter=/path/to/drafter)"
                ) from err
        config = Qwen3Config.from_pretrained(directory)
        state = {}
        for file in sorted(directory.glob("*.safetensors")):
            state.update(load_file(file))
        if LEGACY_VOCAB_KEY in state:  # an older BlockPilot folder: absolute ids -> d2t
            state["d2t"] = draft_offsets(state.pop(LEGACY_VOCAB_KEY))
            config.draft_vocab_size = int(state["d2t"].numel())
        head_rows = state.pop(HEAD_KEY, None)
        model = cls(config)
        expected = model.state_dict()
        wrong = {k: (tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items()
                 if k in expected and tuple(v.shape) != tuple(expected[k].shape)}
        if wrong:
            taps = len(model.target_layer_ids)
            hint = ""
            if "fc.weight" in wrong:
                made_for = wrong["fc.weight"][0][1] / config.hidden_size
                hint = (f" fc.weight is made for {made_for:g} target-layer taps but dflash_config.target_layer_ids lists {taps} "
                        f"({model.target_layer_ids}): set target_layer_ids in {directory / CONFIG_NAME} to the taps it was "
                        "trained with.")
            details = "; ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in list(wrong.items())[:5])
            raise ValueError(f"drafter checkpoint {directory} does not match its config ({details}).{hint} "
                             "Use the config.json saved with these weights.")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint {directory} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model = model.to(device=device, dtype=dtype).eval()
        if model.d2t is not None and head_rows is not None:
            model.draft_lm_head = head_rows.to(device)
        return model


def _name_key(name: str | None) -> str | None:
    """``Qwen/Qwen3-4B``, ``/models/Qwen3-4B`` -> ``qwen3-4b`` (the last path component, lower case)."""
    return str(name).rstrip("/").split("/")[-1].lower() if name else None


def drafter_target_name(config: PretrainedConfig) -> str | None:
    """The target a drafter config names (``dflash_config.target_model``, ``target_model`` or
    ``target_model_name_or_path``), or None when it names none (z-lab checkpoints)."""
    dflash = getattr(config, "dflash_config", None) or {}
    for name in (dflash.get("target_model"), getattr(config, "target_model", None),
                 getattr(config, "target_model_name_or_path", None)):
        if name:
            return str(name)
    return None


def check_compatible(drafter: DFlashDrafter, target_config: PretrainedConfig, target_name: str | None = None) -> None:
    """Raise a ``ValueError`` naming the fix when a drafter cannot serve a target.

    Checks hidden size, vocabulary size, the number of target layers the drafter was trained on
    (``num_target_layers``, when the config records it), that every tapped layer exists in the target, and,
    when both are known, that the target the drafter's config names is this one (compared by the last path
    component: ``Qwen/Qwen3-4B`` matches ``/models/Qwen3-4B``).

    Args:
        target_name: the id the target was loaded from (``Target.name``), or None to skip the name check.
    """
    problems = []
    trained_layers = getattr(drafter.config, "num_target_layers", None)
    if trained_layers is not None and int(trained_layers) != target_config.num_hidden_layers:
        problems.append(f"trained on a target with {trained_layers} layers (num_target_layers), this one has "
                        f"{target_config.num_hidden_layers}")
    named = drafter_target_name(drafter.config)
    if named and target_name and _name_key(named) != _name_key(target_name):
        problems.append(f"made for target {named!r}, not {target_name!r}")
    if drafter.config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size {drafter.config.hidden_size} != target's {target_config.hidden_size}")
    if drafter.config.vocab_size != target_config.vocab_size:
        problems.append(f"vocab size {drafter.config.vocab_size} != target's {target_config.vocab_size}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target_config.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {target_config.num_hidden_layers} layers")
    if drafter.draft_vocab is not None and int(drafter.draft_vocab.max()) >= target_config.vocab_size:
        problems.append("draft_vocab holds ids outside the target's vocabulary")
    if not 0 <= drafter.mask_token_id < target_config.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} outside the vocabulary")
    if problems:
        raise ValueError(
            "drafter does not fit the target: " + "; ".join(problems)
            + ". Use the drafter trained for this target (make draft model.target=...)."
        )


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits ``hidden @ weight.T`` on the eager path: hidden [..., H], weight [V, H] -> [..., V].

    A one-off ``LMHead(weight, float32=True)`` (``pipeline.models.backend``: float32 logits of a bf16 head, as the
    decoder computes them); decoders keep their own heads.
    """
    return LMHead(weight, float32=True)(hidden)  # float32 logits for a bf16 head, as the decoder computes them


def num_parameters(module: nn.Module) -> int:
    """Number of parameters of ``module``."""
    return sum(p.numel() for p in module.parameters())


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Position-decayed loss weights exp(-(k-1)/gamma) for block positions k = 1..B-1 (DFlash). Shape [B-1]."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma) if gamma > 0 and math.isfinite(gamma) else torch.ones(block_size - 1)
