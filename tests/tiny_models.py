"""Tiny random targets and drafters for the tests (no downloads; imported by tests/conftest.py and test modules).

``make_tiny_target`` writes a randomly initialised Llama or Qwen3 causal LM (or, for the head and cache edge cases,
a Phi-like one with an LM-head bias or a Gemma2-like one with sliding-window layers and final logit softcapping) with a small byte-level
BPE tokenizer and a ChatML chat template; ``make_tiny_drafter`` writes a random DFlash drafter for it
in the z-lab layout. Both load through the same code as real checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, PhiConfig, PreTrainedTokenizerFast, Qwen3Config

from pipeline.models.drafter import DFlashDrafter, make_drafter_config

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
"""ChatML with Qwen3's ``enable_thinking`` switch: ``enable_thinking=False`` appends an empty think block to the
generation prompt, as Qwen3's own template does (thinking on is the default)."""

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } : ; , .",
    "Write a function that returns the sum of a list of numbers. for i in range(10): print(i)",
]


def make_tiny_tokenizer(vocab_size: int = 320, chat_template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few lines, with ChatML specials and ``chat_template`` (ChatML; or
    ``QWEN3_TEMPLATE``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>")
    fast.chat_template = chat_template
    return fast


def make_tiny_target(directory: str | Path, arch: str = "llama", hidden_size: int = 64, num_layers: int = 4,
                     seed: int = 0, init_std: float = 0.08, max_positions: int = 512, sliding_window: int = 8,
                     softcap: float = 2.0, head_bias_std: float = 1.0, chat_template: str = CHATML_TEMPLATE) -> Path:
    """Write a tiny random causal LM and its tokenizer to ``directory``.

    Args:
        arch: ``llama``, ``qwen3``, ``phi`` (untied LM head with a random bias, std ``head_bias_std``) or ``gemma2``
            (alternating sliding-window layers of ``sliding_window`` positions, ``final_logit_softcapping=softcap``).
        init_std: larger than the default, for peaked next-token distributions: greedy outputs repeat often and
            drafts get accepted.
        chat_template: the tokenizer's template (ChatML; ``QWEN3_TEMPLATE`` for Qwen3's ``enable_thinking`` switch).
    Raises:
        ValueError: for another ``arch``.
    """
    directory = Path(directory)
    tokenizer = make_tiny_tokenizer(chat_template=chat_template)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden_size // 4, max_position_embeddings=max_positions, initializer_range=init_std,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "phi":
        config = PhiConfig(**{**common, "tie_word_embeddings": False})
    elif arch == "gemma2":
        config = Gemma2Config(**common, sliding_window=sliding_window, final_logit_softcapping=softcap,
                              attn_logit_softcapping=None, query_pre_attn_scalar=hidden_size // 4)
    else:
        raise ValueError(f"arch must be llama, qwen3, phi or gemma2, got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "phi":
        with torch.no_grad():
            model.lm_head.bias.normal_(0.0, head_bias_std)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_drafter(target_dir: str | Path, directory: str | Path, block_size: int = 4, num_layers: int = 1,
                      seed: int = 0, target_layer_ids: list[int] | None = None) -> Path:
    """Write a random DFlash drafter for the target at ``target_dir`` (z-lab layout)."""
    target_config = AutoModelForCausalLM.from_pretrained(target_dir).config
    torch.manual_seed(seed)
    ids = target_layer_ids if target_layer_ids is not None else [0, target_config.num_hidden_layers - 2]
    drafter = DFlashDrafter(make_drafter_config(target_config, num_layers=num_layers, block_size=block_size,
                                                target_layer_ids=ids, mask_token_id=0))
    drafter.save_pretrained(directory, dtype=torch.float32)
    return Path(directory)


def train_tiny_drafter(target_dir: str | Path, directory: str | Path, block_size: int = 4, steps: int = 60,
                       num_prompts: int = 16, max_new_tokens: int = 48, seed: int = 0) -> Path:
    """Train a tiny drafter on the tiny target's own greedy outputs (the real drafting code path).

    A few dozen steps give tau well above 1 on the tiny target, so tests exercise accepted drafts.
    """
    import lightning as L
    from torch.utils.data import DataLoader

    from pipeline.drafting.data import AnchorDataset, collate
    from pipeline.drafting.module import DrafterModule
    from pipeline.drafting.responses import generate_batch
    from pipeline.models.target import load_target
    from pipeline.prompts import chat_input_ids

    target = load_target(str(target_dir))
    L.seed_everything(seed, workers=False)
    drafter = DFlashDrafter(make_drafter_config(target.model.config, num_layers=1, block_size=block_size,
                                                target_layer_ids=[0, target.model.config.num_hidden_layers - 2], mask_token_id=0))
    words = " ".join(_CORPUS).split()
    prompts = [chat_input_ids(target.tokenizer, [" ".join(words[i : i + 3 + i % 5])])[0] for i in range(num_prompts)]
    sequences = [
        {"tokens": t, "features": f, "prompt_length": len(p)}
        for (t, f), p in zip(generate_batch(target, prompts, drafter.target_layer_ids, max_new_tokens), prompts)
        if len(t) - len(p) >= 2
    ]
    module = DrafterModule(drafter, target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight,
                           lr=3e-3, warmup_steps=5, max_steps=steps, gamma=4.0)
    loader = DataLoader(AnchorDataset(sequences, 8, seed), batch_size=8, shuffle=True, collate_fn=collate)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    drafter.save_pretrained(directory, dtype=torch.float32)
    return Path(directory)
