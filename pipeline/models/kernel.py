"""Building and loading the ``smallm`` AVX2 kernel (``kernels/smallm.cpp``) once per process.

``torch.utils.cpp_extension.load`` compiles it on first use (~45 s, cached under ``~/.cache/torch_extensions``). On a
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
LOCK_WAIT_S = 300.0  # a build takes ~45 s; a lock older than this was left by a killed build
_KERNEL_NAME = "blockpilot_smallm"
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
    from torch.utils import cpp_extension

    try:
        limit = float(os.environ.get(LOCK_WAIT_ENV, LOCK_WAIT_S))
    except ValueError:
        raise ValueError(f"${LOCK_WAIT_ENV} must be a number of seconds, got {os.environ.get(LOCK_WAIT_ENV)!r}") from None
    try:
        _check_build_lock(Path(cpp_extension._get_build_directory(_KERNEL_NAME, verbose=False)), limit)
        # -fopenmp: at::parallel_for runs on torch's OpenMP threads (torch's own libgomp.so.1 is already loaded)
        _module = cpp_extension.load(_KERNEL_NAME, [str(SMALLM_SOURCE)],
                                     extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"],
                                     extra_ldflags=["-fopenmp"], verbose=False)
    except KernelUnavailableError:
        raise
    except Exception as err:  # compiler, ninja or header problems
        raise _fail(f"could not build the smallm kernel ({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
                    "install a C++ compiler and ninja, or use model.backend=onednn") from err
    return _module


_module = None  # the loaded extension
