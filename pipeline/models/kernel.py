"""Building and loading the ``smallm`` kernel (``kernels/smallm.cpp``) once per process, for the widest instruction set
this CPU runs.

The ISA is chosen at run time from what the CPU reports (``cpu_isa``: ``avx512`` where /proc/cpuinfo lists AVX-512
F/BW/VL/DQ, else ``avx2`` with FMA; ``$BLOCKPILOT_SMALLM_ISA`` forces one the CPU has) and the source is compiled for
it as its own extension (``blockpilot_smallm_<isa>``): the AVX-512 build's products hold up to 16 rows per tile. Both
builds give the same bits (the same FMA chain per output). ``torch.utils.cpp_extension.load`` compiles it on first
use (~1 min, cached under ``~/.cache/torch_extensions``). On a
machine without a C++ compiler or ninja the build fails: the failure is remembered for the process with its reason
(``kernel_failure``) and warned once, so ``model.backend=auto`` falls back (``pipeline.models.backend``) without
retrying the build for every new decoder. torch waits without limit on a build lock; a lock left by a killed build is
reported here with the path to remove instead.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SMALLM_SOURCE = Path(__file__).with_name("kernels") / "smallm.cpp"


class KernelUnavailableError(RuntimeError, ValueError):
    """The smallm kernel cannot run in this process (no AVX2, no compiler or ninja, a stale build lock).

    Both a ``RuntimeError`` (``smallm_kernel``) and a ``ValueError`` (``resolve_backend`` with ``model.backend=smallm``);
    the message says why and names the fix. The test suite skips tests that need the kernel when it meets one.
    """


LOCK_WAIT_ENV = "BLOCKPILOT_SMALLM_LOCK_WAIT_S"
"""Seconds a ``torch_extensions`` build lock may be held before it is reported as stale (default ``LOCK_WAIT_S``)."""
LOCK_WAIT_S = 300.0  # a build takes ~1 min; a lock older than this was left by a killed build
_KERNEL_NAME = "blockpilot_smallm"
ISA_ENV = "BLOCKPILOT_SMALLM_ISA"
"""Forces the kernel's instruction set (``avx2`` or ``avx512``; one this CPU has); unset: the widest it has."""
AMX_ENV = "BLOCKPILOT_AMX"
"""0: the kernel's int8 products never run on AMX tiles (AVX-512 VNNI alone, the same bits); unset: where the CPU has them."""
ISAS = ("avx512", "avx2")  # widest first
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
              "avx2": ["-mavx2", "-mfma", "-mf16c"]}
_ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}, "avx2": {"avx2", "fma"}}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_isas(flags: set[str] | None = None) -> list[str]:
    """The kernel's instruction sets this CPU runs, widest first (``flags``: /proc/cpuinfo's by default)."""
    flags = cpu_flags() if flags is None else flags
    if not flags:  # no /proc/cpuinfo: ask torch
        capability = torch.backends.cpu.get_cpu_capability()
        return ["avx512", "avx2"] if capability == "AVX512" else ["avx2"] if capability == "AVX2" else []
    return [isa for isa in ISAS if _ISA_NEEDS[isa] <= flags]


def cpu_isa() -> str | None:
    """The instruction set the kernel is built for here: ``$BLOCKPILOT_SMALLM_ISA`` when set, else the widest this CPU
    runs; None when it runs none (no AVX2/FMA).

    Raises:
        KernelUnavailableError: when the variable names an unknown ISA or one this CPU lacks.
    """
    have = supported_isas()
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise KernelUnavailableError(f"${ISA_ENV}={forced!r} is not one of {list(ISAS)}; unset it to use the widest")
        if forced not in have:
            raise KernelUnavailableError(f"${ISA_ENV}={forced} but this CPU runs only {have or 'neither'}; unset it")
        return forced
    return have[0] if have else None
_failure: str | None = None  # why the kernel could not be had in this process (remembered, warned once)


def kernel_failure() -> str | None:
    """Why the smallm kernel is unavailable in this process (the first failure's reason), or None when it has not
    failed (built, loaded, or not tried yet)."""
    return _failure


def _fail(reason: str) -> KernelUnavailableError:
    """Remember ``reason`` for the process, warn once, and return the error to raise."""
    global _failure
    if _failure is None:
        _failure = reason
        log.warning("%s (remembered for this process: every later use falls back without retrying the build)", reason)
    return KernelUnavailableError(_failure)


def _check_build_lock(build_dir: Path, limit_s: float, poll_s: float = 0.5) -> None:
    """Wait while another process holds the build lock ``build_dir/lock`` (a build in progress), at most until the lock
    is ``limit_s`` seconds old; torch's own wait has no limit, so a lock left by a killed build would hang forever.

    Raises:
        KernelUnavailableError: when the lock is (or becomes) older than ``limit_s``; names the path to remove.
    """
    lock = build_dir / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > limit_s:
            raise _fail(f"the smallm kernel's build lock {lock} has been held for {age:.0f} s, longer than a build takes "
                        f"({limit_s:.0f} s, ${LOCK_WAIT_ENV}): a killed build left it. Remove it (rm {lock}) and rerun; "
                        "meanwhile model.backend=auto falls back to onednn/eager")
        time.sleep(poll_s)


def smallm_kernel():
    """The compiled ``smallm`` extension (built on first use, then loaded from torch's extension cache).

    A failure is remembered for the process with its reason (``kernel_failure``) and warned once: later calls raise at
    once instead of retrying the build for every new decoder. A build lock under ``torch_extensions`` older than
    ``$BLOCKPILOT_SMALLM_LOCK_WAIT_S`` (default 300 s) is reported with the path to remove instead of waiting forever.

    Raises:
        KernelUnavailableError (a RuntimeError): when this CPU lacks AVX2/FMA, the build fails (no C++ compiler or
            ninja) or a stale lock blocks it; the message names the fix (``model.backend=onednn``).
    """
    global _module
    if _module is not None:
        return _module
    if _failure is not None:
        raise KernelUnavailableError(_failure)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise _fail(f"the smallm kernel needs an AVX2 CPU (this one reports {capability}); "
                    "use model.backend=onednn or eager")
    isa = cpu_isa() or "avx2"
    name = f"{_KERNEL_NAME}_{isa}"
    from torch.utils import cpp_extension

    try:
        limit = float(os.environ.get(LOCK_WAIT_ENV, LOCK_WAIT_S))
    except ValueError:
        raise ValueError(f"${LOCK_WAIT_ENV} must be a number of seconds, got {os.environ.get(LOCK_WAIT_ENV)!r}") from None
    try:
        _check_build_lock(Path(cpp_extension._get_build_directory(name, verbose=False)), limit)
        # -fopenmp: at::parallel_for runs on torch's OpenMP threads (torch's own libgomp.so.1 is already loaded)
        _module = cpp_extension.load(name, [str(SMALLM_SOURCE)],
                                     extra_cflags=["-O3", *_ISA_FLAGS[isa], "-fopenmp", "-ffp-contract=off"],
                                     extra_ldflags=["-fopenmp"], verbose=False)
    except KernelUnavailableError:
        raise
    except Exception as err:  # compiler, ninja or header problems
        raise _fail(f"could not build the smallm kernel ({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
                    "install a C++ compiler and ninja, or use model.backend=onednn") from err
    global _amx
    _amx = bool(_module.set_amx(os.environ.get(AMX_ENV, "1") != "0"))  # where the CPU and Linux allow it
    return _module


_module = None  # the loaded extension


def loaded_kernel():
    """The ``smallm`` extension where this process has already loaded it, else None (never builds it)."""
    return _module


def kernel_isa() -> str | None:
    """The instruction set of the smallm kernel loaded in this process (``avx512`` | ``avx2``, ``+amx`` where its int8
    products of several rows run on AMX tiles), or None when it is not loaded (not built yet, or unavailable here)."""
    if _module is None:
        return None
    return _module.isa() + ("+amx" if _amx else "")


def set_amx(on: bool) -> bool:
    """Run the kernel's int8 products of 12 rows or more (q4 and q8) on AMX tiles (on) or AVX-512 VNNI alone
    (off); the same bits either way (``smallm.cpp`` int8_tile_amx). Granted only where the CPU has AMX-INT8 and Linux
    lets this process use the tile state. Returns whether they now run on AMX (loads the kernel)."""
    global _amx
    _amx = bool(smallm_kernel().set_amx(bool(on)))
    return _amx


_amx = False  # the loaded kernel's int8 products run on AMX (set_amx)
