"""The one atomic write of the package: a file or folder is built beside its place, then renamed into it, so a reader
(or a run killed half-way) never sees half of it. The bottom layer: standard library only.

* ``write_atomic(path, text | bytes)`` / ``write_json_atomic(path, obj)``: a whole file at once;
* ``atomic_file(path)``: a context manager yielding the temporary file to write (``torch.save``, ``save_file``);
* ``atomic_dir(path)``: likewise a temporary folder, which replaces a folder already at ``path`` (moved aside first,
  then deleted: a folder cannot be renamed over a non-empty one);
* ``publish_new(write, directory, pattern)`` / ``create_once(path, write)``: a new file that replaces none (the label
  shards: the first free name; ``meta.json``: the first writer wins), published by a hard link;
* ``move_aside(path, to)``: the one rename that publishes nothing (a file set aside, e.g. a bad shard or ``.old``).

Every ``os.replace`` / rename / ``os.link`` of the package lives here (``tests/test_files.py`` checks it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def atomic_file(path: str | Path, keep_old: bool = False) -> Iterator[Path]:
    """Yield a temporary file beside ``path`` to write; when the block ends without error it is renamed to ``path``
    (replacing any file there, kept as ``<name>.old`` with ``keep_old``), else removed.

    The temporary file is hidden and unique (``.<name>.tmp-<pid>-<random>``): no glob of the folder's files by their
    suffix sees it, and two writers of one path never share it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if keep_old and path.exists():
            move_aside(path, path.with_name(path.name + ".old"))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_atomic(path: str | Path, data: str | bytes, keep_old: bool = False) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) at ``path`` atomically; returns ``path``."""
    with atomic_file(path, keep_old) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 2, default=None, newline: bool = True,
                      keep_old: bool = False) -> Path:
    """``obj`` as JSON at ``path`` atomically (``indent``, ``default`` as ``json.dumps``; a final newline unless
    ``newline`` is False); returns ``path``."""
    return write_atomic(path, json.dumps(obj, indent=indent, default=default) + ("\n" if newline else ""), keep_old)


@contextlib.contextmanager
def atomic_dir(path: str | Path, mode: int | None = None) -> Iterator[Path]:
    """Yield a new temporary folder beside ``path`` to fill; when the block ends without error it replaces ``path``
    (a folder already there is moved aside, the new one renamed in, the old one deleted), else it is deleted.

    Args:
        mode: the folder's permissions (``tempfile.mkdtemp`` makes it 0o700).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    old = None
    try:
        if mode is not None:
            tmp.chmod(mode)
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            move_aside(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old is not None:  # put the old folder back
                move_aside(old, path)
                old = None
            raise
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            elif leftover is not None and leftover.exists():  # a file stood where the folder goes
                leftover.unlink()


def move_aside(path: str | Path, to: str | Path) -> Path:
    """Move the file or folder ``path`` to ``to`` (replacing a file there; its folder made): a rename that publishes
    nothing. Returns ``to``."""
    to = Path(to)
    to.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, to)
    return to


def publish_new(write: Callable[[Path], None], directory: str | Path, pattern: str, start: int = 0) -> Path:
    """Write a new file through ``write(tmp)`` and publish it, without replacing any, at the first free
    ``pattern.format(i)`` (i >= ``start``) of ``directory`` (a hard link: two writers never take one name); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-{os.getpid()}-{uuid.uuid4().hex}{Path(pattern).suffix}"
    index = start
    try:
        write(tmp)
        while True:
            final = directory / pattern.format(index)
            try:
                os.link(tmp, final)
                return final
            except FileExistsError:
                index += 1
    finally:
        tmp.unlink(missing_ok=True)


def create_once(path: str | Path, write: Callable[[Path], None]) -> bool:
    """Write ``path`` through ``write(tmp)`` unless a file is there (the first writer wins; a hard link, so a reader
    never sees half of it); returns whether this call created it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex}{path.suffix}")
    try:
        write(tmp)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
