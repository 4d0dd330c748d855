"""The forward-path backends (``pipeline.models.backend``): packed linears (oneDNN, and the smallm AVX2
kernel) give F.linear's values, are batch-invariant row by row, follow weight updates and gradients, and
every decoder output on them is token-identical to transformers' own greedy ``generate`` and to B=1 for
every B."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.decoding import DecodeConfig, SpeculativeDecoder
import os
import subprocess
import sys
import time
import types

from pipeline import PROJECT_ROOT
from pipeline.models.backend import (EXACT_ROWS_ENV, SMALLM, SMALLM_MAX_ROWS, KernelUnavailableError, LMHead, PackedLinear,
                                    batch_invariant, exact_crossover, exact_format, kernel_failure, measure_crossover,
                                    module_backend, pack_smallm, resolve_backend, set_backend, smallm_available)
from pipeline.models.drafter import DFlashDrafter
from pipeline.models.target import load_target
from pipeline.prompts import chat_input_ids

PROMPTS = ["def add(a, b):", "Natalia sold clips to 48 of her friends", "The quick brown fox"]


@pytest.fixture(autouse=True)
def _kernel_or_skip(request):
    """The kernel's own tests (a ``smallm``/``smallm_f32`` backend parameter, or ``smallm`` in the test's name) are
    skipped with the build failure's reason where the kernel cannot be built (no compiler or ninja)."""
    params = getattr(request.node, "callspec", None)
    wants = (params is not None and params.params.get("backend") in SMALLM) or "smallm" in request.node.name
    if wants and not smallm_available():
        pytest.skip(f"the smallm kernel is unavailable here: {kernel_failure()}")


@pytest.fixture
def eager_afterwards(tiny):
    """Put the shared tiny models back on the eager path after the test."""
    yield
    for arch in ("llama", "qwen3"):
        set_backend(tiny.target(arch).model, "eager")


def hf_greedy(target, ids: torch.Tensor, max_new_tokens: int, stop_ids) -> list[int]:
    """transformers' own greedy decoding (its loop, its cache), cut like the decoder's output."""
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                                pad_token_id=target.tokenizer.pad_token_id or 0)
    return out[0, ids.shape[1]:].tolist()


PACKED = ["onednn", "smallm", "smallm_f32"]


def gguf_round(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` [N, K] as GGUF would store and dequantize it: Q4_1 (blocks of 32 along K, float16 scale d and
    minimum m, w = d * q + m, q in 0..15), Q8_0 (float16 d, w = d * q, q int8) or bf16."""
    if kind == "bf16":
        return weight.bfloat16().float()
    n, k = weight.shape
    blocks = weight.view(n, k // 32, 32)
    if kind == "q8":
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
        return (d * torch.round(blocks / d).clamp(-128, 127).to(torch.int8).float()).view(n, k)
    m = blocks.amin(-1, keepdim=True).half().float()
    d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float()
    return ((d * torch.round((blocks - m) / d).clamp(0, 15).to(torch.uint8).float()) + m).view(n, k)


@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
@pytest.mark.parametrize("shape", [(576, 576), (40, 64), (1536, 96)])
def test_smallm_streams_exact_forms_and_computes_the_float32_kernels_bits(kind, shape):
    """A weight whose float32 values are a GGUF Q4_1 / Q8_0 or bf16 tensor's is stored in that form, expands back
    to the same bits, and every output equals the float32 panels' output bit for bit, alone or in a verify."""
    torch.manual_seed(0)
    weight = gguf_round(torch.randn(shape) * 0.05, kind)
    packed, plain = pack_smallm(weight, exact_rows=3), pack_smallm(weight, ())
    assert packed.fmt == kind and plain.fmt == "f32" and exact_format(weight) == kind
    assert packed.f32 is not None and plain.f32 is None  # float32 panels beside the exact form, for wide calls
    assert packed.nbytes < plain.nbytes / (1.9 if kind == "bf16" else 3.5)
    assert torch.equal(packed.dense().view(torch.int32), weight.view(torch.int32))
    x, bias = torch.randn(SMALLM_MAX_ROWS, shape[1]), torch.randn(shape[0])
    full = packed(x, bias)
    assert torch.equal(full, plain(x, bias))
    torch.testing.assert_close(full, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    exact_only = pack_smallm(weight, exact_rows=SMALLM_MAX_ROWS)  # the exact form at every width (no float32 panels)
    assert exact_only.fmt == kind and exact_only.f32 is None
    assert torch.equal(exact_only(x, bias), full)
    for m in range(1, SMALLM_MAX_ROWS + 1):  # register-fused row tiles up to 4 rows, buffered groups above
        assert torch.equal(packed(x[:m].contiguous(), bias), full[:m]), f"{m} rows"
        assert torch.equal(exact_only(x[:m].contiguous(), bias), full[:m]), f"{m} rows, exact form"
        assert torch.equal(packed(x[m - 1 : m].contiguous(), bias), full[m - 1 : m]), f"row {m - 1} alone"


def test_smallm_keeps_float32_for_weights_no_exact_form_holds():
    torch.manual_seed(0)
    weight = gguf_round(torch.randn(64, 64), "q4")
    weight[3, 5] += 1e-3  # one value off the 4-bit grid of its block
    assert exact_format(weight) is None and pack_smallm(weight).fmt == "f32"
    assert pack_smallm(torch.randn(64, 64)).fmt == "f32" and exact_format(torch.randn(64, 64)) is None
    assert pack_smallm(gguf_round(torch.randn(64, 64), "q4")[:, :48].contiguous()).fmt == "f32"  # K not a multiple of 32
    assert pack_smallm(gguf_round(torch.randn(64, 64), "q4"), ()).fmt == "f32"  # smallm_f32
    # a 4-bit grid whose offsets float16 does not hold (not a GGUF Q4_1 block's): the int8 products stream float16
    d = torch.full((64, 2, 1), 2.0 ** -6)
    offsets = torch.full((64, 2, 1), 0.1) + torch.arange(64.0).view(64, 1, 1) * 1e-6
    assert not torch.equal(offsets.half().float(), offsets)
    weight = ((d * torch.randint(0, 16, (64, 2, 32)).float()) + offsets).view(64, 64)
    assert exact_format(weight) is None and pack_smallm(weight).fmt == "f32"
    from pipeline.models.native import q4_scales
    with pytest.raises(ValueError, match="float16"):
        q4_scales(d.view(4, 16, 2).transpose(1, 2), offsets.view(4, 16, 2).transpose(1, 2))


def test_smallm_crossover_is_measured_forced_or_refused(monkeypatch):
    """Where float32 panels take over from an exact form is this machine's measurement (a row count per format,
    SMALLM_MAX_ROWS when exact wins throughout), can be forced by the environment, and a bad value names the fix.
    Whatever the crossover, packing keeps float32 panels exactly when some call width would use them."""
    measured = measure_crossover(megabytes=4.0, rows=(2, 4, 8))
    assert set(measured) == {"q4", "q8", "bf16"}
    assert all(v in (1, 2, 4, SMALLM_MAX_ROWS) for v in measured.values()), measured
    weight = gguf_round(torch.randn(64, 64) * 0.05, "q4")
    monkeypatch.setenv(EXACT_ROWS_ENV, "5")
    exact_crossover.cache_clear()
    try:
        assert exact_crossover() == {"q4": 5, "q8": 5, "bf16": 5}
        forced = pack_smallm(weight)
        assert forced.exact_rows == 5 and forced.f32 is not None
        monkeypatch.setenv(EXACT_ROWS_ENV, str(SMALLM_MAX_ROWS + 10))
        exact_crossover.cache_clear()
        wide = pack_smallm(weight)
        assert wide.exact_rows == SMALLM_MAX_ROWS and wide.f32 is None  # no float32 copy that no call would use
        monkeypatch.setenv(EXACT_ROWS_ENV, "many")
        exact_crossover.cache_clear()
        with pytest.raises(ValueError, match="positive int.*unset it"):
            exact_crossover()
    finally:
        monkeypatch.delenv(EXACT_ROWS_ENV)
        exact_crossover.cache_clear()


def test_smallm_decodes_a_gguf_rounded_target_losslessly_on_its_compressed_weights(tiny, eager_afterwards):
    """The embedded default's case on a tiny model: every linear of the target Q4_1-rounded (the LM head Q8_0),
    streamed as 4 / 8 bits; B=1 equals transformers' greedy ``generate``, and every B equals B=1."""
    from pipeline.models.backend import _Packed
    from tiny_models import make_tiny_target
    from pipeline.models.target import load_target

    target = load_target(str(make_tiny_target(tiny.root / "gguf-rounded", "llama")), dtype="float32")
    with torch.no_grad():
        for name, param in target.model.named_parameters():
            if param.dim() == 2:
                param.copy_(gguf_round(param, "q8" if "embed" in name or "lm_head" in name else "q4"))
    decoder = SpeculativeDecoder(target, tiny.drafter("llama", "trained"), backend="smallm")
    formats = {m._bp_packed.get().fmt for m in target.model.modules() if type(m) is PackedLinear}
    assert formats == {"q4"} and decoder.head._product._packed.get().fmt == "q8"
    assert isinstance(decoder.head._product._packed, _Packed)
    config = DecodeConfig(max_new_tokens=24)
    for text in PROMPTS:
        ids = chat_input_ids(target.tokenizer, [text])
        ours = decoder.generate(ids, 1, config).output_ids
        set_backend(target.model, "eager")
        assert ours == hf_greedy(target, ids, config.max_new_tokens, decoder.stop_ids), text
        set_backend(target.model.base_model, "smallm")
        for B in (2, 4, 8, 16):
            assert decoder.generate(ids, B, config).output_ids == ours, f"B={B} on {text!r}"


@pytest.mark.parametrize("backend", PACKED)
@pytest.mark.parametrize("shape", [(576, 576), (37, 24), (1536, 576), (16, 7)])
def test_packed_linear_matches_f_linear_and_is_batch_invariant(shape, backend):
    torch.manual_seed(0)
    layer = nn.Linear(shape[1], shape[0], bias=True)
    x = torch.randn(SMALLM_MAX_ROWS, shape[1])
    with torch.inference_mode():
        reference = F.linear(x, layer.weight, layer.bias)
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        set_backend(layer, backend)
        assert type(layer) is PackedLinear and module_backend(layer) == backend
        full = layer(x)
        torch.testing.assert_close(full, reference, atol=1e-4, rtol=1e-4)
        for m in (1, 2, 3, 5, 7, 8, 13, 16):  # a row's result does not depend on how many rows share the call
            assert torch.equal(layer(x[:m]), full[:m]), f"{m} rows"
        assert torch.equal(layer(x[:16].view(2, 8, -1)).reshape(16, -1), full[:16])  # [..., K] inputs
        many = torch.randn(SMALLM_MAX_ROWS + 5, shape[1])  # a prefill-sized input
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), atol=1e-4, rtol=1e-4)
    set_backend(layer, "eager")
    assert type(layer) is nn.Linear and not hasattr(layer, "_bp_packed")
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())


def test_set_backend_switches_between_packed_backends():
    layer = nn.Linear(8, 16)
    set_backend(layer, "onednn")
    set_backend(layer, "smallm")
    assert module_backend(layer) == "smallm" and layer._bp_packed.kind == "smallm"
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        set_backend(layer, "auto")


@pytest.mark.parametrize("backend", PACKED)
def test_packed_linear_repacks_after_a_weight_update_and_passes_gradients(backend):
    torch.manual_seed(0)
    layer = set_backend(nn.Linear(16, 8, bias=False), backend)
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # an optimizer step changes the weight in place
        torch.testing.assert_close(layer(x), 2 * before)
    loss = layer(x.requires_grad_()).sum()  # gradients: plain F.linear
    loss.backward()
    torch.testing.assert_close(layer.weight.grad, x.detach().sum(0).expand(8, 16))


def test_lm_head_backends_agree():
    torch.manual_seed(0)
    weight, hidden = torch.randn(1000, 64), torch.randn(2, 8, 64)
    for backend in ["eager", *PACKED]:
        logits = LMHead(weight, backend)(hidden)
        assert logits.shape == (2, 8, 1000)
        torch.testing.assert_close(logits, hidden @ weight.T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="'eager' or one of"):
        LMHead(weight, "auto")


def test_resolve_backend_names_the_fix():
    if smallm_available():  # the CI CPU has AVX2 and a compiler
        assert resolve_backend("auto", "cpu", torch.float32) == "smallm"
        assert resolve_backend("smallm", "cpu", torch.float32) == "smallm"
    else:  # no compiler: auto falls back, and asking for the kernel names why it is missing
        assert resolve_backend("auto", "cpu", torch.float32) == "onednn"
        with pytest.raises(ValueError, match="smallm"):
            resolve_backend("smallm", "cpu", torch.float32)
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "eager"
    assert resolve_backend("eager", "cpu", torch.float32) == "eager"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("inductor", "cpu", torch.float32)
    with pytest.raises(ValueError, match="float32 on CPU only"):
        resolve_backend("onednn", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="float32 on CPU only"):
        resolve_backend("smallm", "cuda", torch.float32)


@pytest.mark.parametrize("backend", ["eager", *PACKED])
def test_b1_equals_transformers_generate(tiny, arch, backend, eager_afterwards):
    """The independent reference: B=1 is transformers' greedy decoding, token for token."""
    target = tiny.target(arch)
    decoder = SpeculativeDecoder(target, tiny.drafter(arch, "random", 4), backend=backend)
    assert module_backend(target.model) == backend
    config = DecodeConfig(max_new_tokens=24)
    for text in PROMPTS:
        ids = chat_input_ids(target.tokenizer, [text])
        ours = decoder.generate(ids, 1, config).output_ids
        set_backend(target.model, "eager")  # the reference runs transformers' own path
        reference = hf_greedy(target, ids, config.max_new_tokens, decoder.stop_ids)
        set_backend(target.model.base_model, backend)
        assert ours == reference, f"B=1 on {backend} differs from generate on {text!r}"


@pytest.mark.parametrize("backend", PACKED)
def test_packed_backends_are_lossless_for_every_block_size(tiny, backend, eager_afterwards):
    target = tiny.target("llama")
    decoder = SpeculativeDecoder(target, tiny.drafter("llama", "trained"), backend=backend)
    assert module_backend(decoder.drafter) == backend and decoder.head.backend == backend
    config, accepted = DecodeConfig(max_new_tokens=32), 0
    for text in PROMPTS:
        ids = chat_input_ids(target.tokenizer, [text])
        reference = decoder.generate(ids, 1, config).output_ids
        for B in range(2, 17):
            stats = decoder.generate(ids, B, config)
            assert stats.output_ids == reference, f"B={B} on {backend} diverges from B=1 on {text!r}"
            accepted += sum(t > 1 for t in stats.taus)
    assert accepted > 20  # drafts really were accepted


def test_verify_width_is_lossless(trained_decoder):
    """``step(..., verify_width=k)``: the target checks only the first k drafts (0 = a plain step)."""
    from pipeline.decoding.sampling import PositionKeyedSampler
    from pipeline.decoding.step import chain_step

    decoder, config = trained_decoder, DecodeConfig(max_new_tokens=30)
    ids = chat_input_ids(decoder.target.tokenizer, [PROMPTS[0]])
    reference = decoder.generate(ids, 1, config).output_ids
    sampler = PositionKeyedSampler(0.0, 0, decoder.lm_head.shape[0])
    for B, k in [(8, 0), (8, 1), (8, 3), (8, 7), (16, 5), (4, 9)]:
        with torch.inference_mode():
            state = decoder.new_state(decoder.prefill(ids, config), use_drafter=True)
            out = [state.pending]
            while len(out) < config.max_new_tokens:
                new, accepted = chain_step(decoder, state, sampler, B, k)
                assert len(new) == accepted + 1 <= min(k, B - 1) + 1
                out.extend(new)
        assert out[: config.max_new_tokens] == reference, f"B={B}, k={k}"


@pytest.mark.parametrize("backend", PACKED)
def test_models_loaded_under_inference_mode_run_on_the_packed_paths(tiny, backend):
    """Weights made under ``torch.inference_mode`` (a model loaded inside it) have no version counter; the packed
    weights and the lean forwards pack them once and decode what transformers' generate decodes."""
    source = tiny.target("llama")
    target_dir, drafter_dir = tiny.target_dir("llama"), tiny.drafter_dir("llama", "trained")  # (trains it once)
    with torch.inference_mode():  # as a script under @torch.inference_mode() loads them
        target, drafter = load_target(str(target_dir)), DFlashDrafter.from_pretrained(drafter_dir)
    assert drafter.layers[0].self_attn.q_proj.weight.is_inference()  # transformers' loader makes the target's normal
    decoder = SpeculativeDecoder(target, drafter, backend=backend)
    config = DecodeConfig(max_new_tokens=20)
    for text in PROMPTS[:2]:
        ids = chat_input_ids(target.tokenizer, [text])
        ours = decoder.generate(ids, 1, config).output_ids
        with torch.inference_mode():
            reference = hf_greedy(source, ids, config.max_new_tokens, decoder.stop_ids)
        assert ours == reference and decoder.generate(ids, 6, config).output_ids == ours, text


# -- kernel build failures (issue 24 item 4) ------------------------------------------------------------------------
@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """The kernel module's process-wide memory (loaded extension, remembered failure) emptied for one test, restored after."""
    from pipeline.models import kernel

    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_failure", None)
    monkeypatch.setattr(kernel, "_amx", kernel._amx)  # restored after: the real module's AMX state is the process's
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    return kernel


def test_a_failed_kernel_build_is_remembered_with_its_reason_and_warned_once(fresh_kernel_state, monkeypatch, tmp_path, caplog):
    from torch.utils import cpp_extension

    calls = []

    def no_compiler(*args, **kwargs):
        calls.append(args[0])
        raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja)")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    with caplog.at_level("WARNING", logger="pipeline.models.kernel"):
        assert not smallm_available()
        assert resolve_backend("auto", "cpu", torch.float32) == "onednn"  # the fallback, without a second build
        for _ in range(3):
            with pytest.raises(KernelUnavailableError, match="Ninja is required"):
                fresh_kernel_state.smallm_kernel()
        with pytest.raises(ValueError, match="could not build the smallm kernel.*model.backend=onednn"):
            resolve_backend("smallm", "cpu", torch.float32)
    assert calls == [f"blockpilot_smallm_{fresh_kernel_state.cpu_isa()}"]  # built once per process, not once per decoder
    assert "Ninja is required" in kernel_failure()
    warnings = [r for r in caplog.records if "smallm" in r.getMessage()]
    assert len(warnings) == 1 and "remembered" in warnings[0].getMessage()


def test_a_stale_build_lock_is_reported_with_the_path_to_remove(fresh_kernel_state, monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("must not wait on or take a stale lock"))
    monkeypatch.setenv(fresh_kernel_state.LOCK_WAIT_ENV, "60")
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left by a build killed an hour ago
    t0 = time.perf_counter()
    with pytest.raises(KernelUnavailableError, match=rf"held for \d+ s.*rm {lock}"):
        fresh_kernel_state.smallm_kernel()
    assert time.perf_counter() - t0 < 30  # reported, not waited on (torch's own wait has no limit)
    assert not smallm_available() and str(lock) in kernel_failure()


def test_a_fresh_build_lock_is_waited_for(fresh_kernel_state, monkeypatch, tmp_path):
    """A lock younger than the limit is a build in progress in another process: wait for it, then load."""
    import threading

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    sentinel = types.SimpleNamespace(set_amx=lambda on: False)  # the loaded module (asked once whether AMX runs)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: sentinel)
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.5, lock.unlink).start()  # the other build finishes
    assert fresh_kernel_state.smallm_kernel() is sentinel and not lock.exists()
    assert fresh_kernel_state.smallm_kernel() is sentinel and kernel_failure() is None


def test_forward_path_names_the_backend_and_whether_it_is_batch_invariant(tiny):
    target = tiny.target("llama")
    eager = SpeculativeDecoder(target, backend="eager").forward_path()
    assert eager["backend"] == "eager" and eager["batch_invariant"] is False
    assert eager["target"].startswith("transformers float32 cpu") and len(eager) <= 6
    onednn = SpeculativeDecoder(target, backend="onednn").forward_path()
    assert onednn["backend"] == "onednn" and onednn["batch_invariant"] is True  # test_packed_linear_..._batch_invariant
    set_backend(target.model, "eager")
    assert batch_invariant("smallm") and batch_invariant("smallm_f32") and not batch_invariant("eager")


@pytest.mark.slow
def test_the_suite_passes_where_no_compiler_can_be_found(tmp_path):
    """A machine without a C++ compiler or ninja (simulated: PATH and CXX point nowhere, an empty torch_extensions):
    the backend and bench tests and a losslessness test pass, the kernel's own tests are skipped with the reason."""
    nowhere = tmp_path / "no-bin"
    nowhere.mkdir()
    env = {**os.environ, "PATH": str(nowhere), "CXX": str(nowhere / "c++"), "CC": str(nowhere / "cc"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"), "PYTHONPATH": str(PROJECT_ROOT)}
    env.pop("CI", None)
    selection = ["tests/test_backend.py", "tests/test_bench_step.py",
                 "tests/test_forward.py::test_off_the_native_stack_a_step_is_transformers_own_forward",
                 "tests/test_decoding.py::test_lossless_for_every_block_size_with_a_trained_drafter"]
    chosen = ("smallm_streams or resolve_backend or b1_equals or packed_backends_are_lossless or forward_path or bench_step "
              "or transformers_own_forward or lossless_for_every")  # the kernel's own tests, the fallback's and the losslessness tests
    result = subprocess.run([sys.executable, "-m", "pytest", *selection, "-q", "-rs", "-p", "no:cacheprovider",
                             "-k", f"({chosen}) and not no_compiler", "-x"],
                            cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and " skipped" in result.stdout, tail
    assert "smallm kernel is unavailable" in result.stdout and "could not build the smallm kernel" in result.stdout, tail


# -- float32 head logits for bf16 models (issue 24 item 7a) ---------------------------------------------------------
def test_bf16_heads_compute_float32_logits_equal_to_a_float32_product(tiny):
    """A bf16 target and drafter (the gpu experiment's dtype): the decoder's target and draft heads return the float32
    product of the bf16 weight and hidden states, not that product rounded to bf16 (whose grid is 0.125 wide for
    logits in [16, 32), so near-ties broke differently between a verify and single steps)."""
    target = load_target(str(tiny.target_dir("qwen3")), dtype="bfloat16")
    drafter = DFlashDrafter.from_pretrained(tiny.drafter_dir("qwen3"), dtype=torch.bfloat16)
    decoder = SpeculativeDecoder(target, drafter)
    weight = decoder.lm_head
    assert weight.dtype == torch.bfloat16
    hidden = (torch.randn(16, weight.shape[1], generator=torch.Generator().manual_seed(0)) * 6).bfloat16()
    reference = (weight.float() @ hidden.float().T).T  # independent: float32 operands, float32 result
    before = (weight @ hidden.T).T  # what the heads computed before: a bf16 product, then .float()
    for head in (decoder.head, decoder.drafter_head):
        logits = head(hidden)
        assert logits.dtype == torch.float32 and torch.equal(logits, reference)
    assert before.dtype == torch.bfloat16 and not torch.equal(before.float(), reference)
    on_grid = lambda x: float((x == x.bfloat16().float()).float().mean())  # noqa: E731
    assert on_grid(before.float()) == 1.0 and on_grid(reference) < 0.5  # the float32 logits keep their low bits
    # through the decoder: prefill logits are float32 off bf16's grid, and decoding runs at every B
    ids = chat_input_ids(target.tokenizer, [PROMPTS[0]])
    config = DecodeConfig(max_new_tokens=12)
    prefill = decoder.prefill(ids, config)
    assert prefill.last_logits.dtype == torch.float32 and on_grid(prefill.last_logits) < 0.5
    outputs = {B: decoder.generate(ids, B, config).output_ids for B in (1, 4)}
    assert all(len(o) == 12 or o[-1] in decoder.stop_ids for o in outputs.values())
    # LMHead's float32 flag leaves a float32 head bit for bit as it was
    w32 = torch.randn(50, 16)
    assert LMHead(w32, float32=True).float32 is False
    assert torch.equal(LMHead(w32, float32=True)(hidden.float()[:, :16]), LMHead(w32)(hidden.float()[:, :16]))
