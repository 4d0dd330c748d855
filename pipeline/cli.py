"""The command line of every stage entry point: ``stage(config_name)`` makes a stage's ``main`` a Hydra app whose
user errors print as one line.

    @stage("evaluate")                        # conf/evaluate.yaml
    def main(cfg: DictConfig) -> None: ...

    if __name__ == "__main__":
        main()

What a user sees on stderr:
  * a bad setting or a missing input, i.e. a ``ValueError`` or ``FileNotFoundError`` that the project's own code raises
    with a message (a ``raise`` statement in ``pipeline/``: the config checks, the prompt and artifact loaders; their
    messages name the key and the fix): ``error: <message>``, exit code 2, no traceback;
  * a misspelt key (``python -m pipeline.evaluate eval.metods=[ar]``): ``error: unknown key eval.metods; did you mean
    eval.methods?`` (the closest key of the composed config), exit code 2; Hydra's other config errors (an unknown
    option of a config group, a malformed override) print Hydra's message after ``error:``, exit code 2;
  * anything else (a bug, an error raised inside a library): the full traceback, exit code 1.
``HYDRA_FULL_ERROR=1`` (Hydra's own switch) shows every error with its full traceback instead. Called with a config
(``main(cfg)``, as tests do) the stage function runs as written and its errors propagate.

How: Hydra reports an exception itself (a trimmed traceback) unless ``HYDRA_FULL_ERROR=1``, in which case it re-raises
it; ``run`` sets that variable for the call so that the errors reach it, and the stage function's own wrapper turns a
user error into the one line before Hydra's job runner sees it.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from pathlib import Path
from typing import Callable

from pipeline import PROJECT_ROOT

CONF_DIR = PROJECT_ROOT / "conf"
PACKAGE_DIR = PROJECT_ROOT / "pipeline"
USER_ERRORS = (ValueError, FileNotFoundError)
EXIT_USER_ERROR = 2
FULL_ERROR = "HYDRA_FULL_ERROR"


class _Guard:
    """Whether ``run`` is handling this process's errors (a launcher's worker process runs its jobs unguarded)."""

    active = False


def fail(message: str) -> None:
    """Print ``error: <message>`` on stderr and exit with ``EXIT_USER_ERROR``.

    Raises:
        SystemExit: always.
    """
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)


def is_user_error(err: BaseException) -> bool:
    """True for a ``ValueError`` / ``FileNotFoundError`` raised by a ``raise`` statement of the project's own code
    (``pipeline/``), i.e. one of its messages naming a setting or a file and the fix; False for one raised inside a
    library (e.g. numpy's shape errors) or by a built-in call that failed (``int("x")``): those are bugs to read in a
    traceback."""
    if not isinstance(err, USER_ERRORS):
        return False
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    file = Path(tb.tb_frame.f_code.co_filename).resolve()
    if not file.is_relative_to(PACKAGE_DIR.resolve()):
        return False
    import linecache

    return linecache.getline(str(file), tb.tb_lineno).lstrip().startswith("raise ")


def config_keys(cfg) -> list[str]:
    """Every key of a composed config as a dotted path, inner nodes included (``eval``, ``eval.methods``, ...)."""
    from omegaconf import OmegaConf

    def walk(node, prefix: str):
        for key, value in node.items():
            path = f"{prefix}{key}"
            yield path
            if isinstance(value, dict):
                yield from walk(value, path + ".")

    return list(walk(OmegaConf.to_container(cfg, resolve=False), ""))


def closest_key(key: str, keys: list[str]) -> str | None:
    """The key of ``keys`` closest to the misspelt ``key`` (difflib), or None when none is close."""
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return match[0] if match else None


def compose_keys(config_name: str, overrides: list[str]) -> list[str]:
    """The keys of ``conf/<config_name>.yaml`` composed with ``overrides`` (with none, when those do not compose
    alone, e.g. a sweep's ``a=1,2``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    for attempt in (overrides, []):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                return config_keys(compose(config_name=config_name, overrides=list(attempt)))
        except Exception:  # noqa: BLE001 - the suggestion is best effort; Hydra's own message is the fallback
            continue
        finally:
            GlobalHydra.instance().clear()
    return []


def unknown_key_message(err: BaseException, config_name: str, command: str, argv: list[str]) -> str | None:
    """The one-line message for Hydra's "Could not override 'x.y'" (a key the config does not have), naming the closest
    existing key; None for any other composition error."""
    found = re.match(r"Could not override '([^']+)'", str(err))
    if not found or "not in struct" not in str(err.__cause__ or ""):
        return None
    key = found.group(1)
    overrides = [a for a in argv if not a.startswith("-") and "=" in a and a.split("=", 1)[0] != key]
    match = closest_key(key, compose_keys(config_name, overrides))
    if match is not None:
        return f"unknown key {key}; did you mean {match}?"
    return (f"unknown key {key}: the {config_name} config has no such key (list its keys with python -m {command} --cfg "
            f"job; a new key needs a leading +, e.g. +{key}=...)")


def run(hydra_main: Callable[[], object], config_name: str, command: str):
    """Run a Hydra app from the command line, turning user errors into one line (see the module docstring).

    Args:
        hydra_main: the ``hydra.main``-decorated function; config_name: its config; command: its module, for messages.
    Raises:
        SystemExit: with ``EXIT_USER_ERROR`` after printing a user error; other exceptions propagate.
    """
    from hydra.errors import CompactHydraException

    if os.environ.get(FULL_ERROR) == "1":
        return hydra_main()
    os.environ[FULL_ERROR] = "1"  # Hydra re-raises instead of printing its own report
    _Guard.active = True
    try:
        return hydra_main()
    except CompactHydraException as err:
        from omegaconf.errors import OmegaConfBaseException

        message = unknown_key_message(err, config_name, command, sys.argv[1:])
        if message is None:  # as Hydra prints it (e.g. an unknown option of a group, with the available ones)
            message = str(err).strip()
            if isinstance(err.__cause__, OmegaConfBaseException):
                message += "\n" + str(err.__cause__).strip()
        fail(message)
    except USER_ERRORS as err:  # raised in a job Hydra ran and reported (a multirun's)
        if is_user_error(err):
            fail(str(err))
        raise
    finally:
        _Guard.active = False
        os.environ.pop(FULL_ERROR, None)


def stage(config_name: str) -> Callable[[Callable], Callable]:
    """Decorator making ``task(cfg)`` a stage entry point on ``conf/<config_name>.yaml`` (Hydra, version base 1.3).

    The decorated ``main()`` reads the command line (``run``); ``main(cfg)`` calls ``task(cfg)`` directly.
    """
    import hydra

    def decorate(task: Callable) -> Callable:
        command = task.__module__
        if command == "__main__":  # python -m pipeline.<stage>
            spec = getattr(sys.modules["__main__"], "__spec__", None)
            command = spec.name if spec is not None else Path(sys.argv[0]).stem

        @functools.wraps(task)  # Hydra unwraps it: the job is named after the stage's module, as before
        def guarded(cfg):
            try:
                return task(cfg)
            except USER_ERRORS as err:
                if _Guard.active and is_user_error(err):
                    fail(str(err))
                raise

        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(guarded)

        @functools.wraps(task)
        def main(cfg=None):
            if cfg is not None:
                return task(cfg)
            return run(hydra_main, config_name, command)

        return main

    return decorate
