"""The one atomic write (``pipeline.files``): files and folders published whole, a failed write leaving nothing, and no
other module of the package renaming a file into place (issue 41)."""

from __future__ import annotations

import ast
import json
import threading

import pytest

from pipeline import PROJECT_ROOT
from pipeline.files import atomic_dir, atomic_file, create_once, move_aside, publish_new, write_atomic, write_json_atomic

HELPER = PROJECT_ROOT / "pipeline" / "files.py"


def test_write_atomic_replaces_whole_files_and_keeps_the_old_copy_on_request(tmp_path):
    path = tmp_path / "sub" / "a.json"
    assert write_json_atomic(path, {"x": 1}) == path and json.loads(path.read_text()) == {"x": 1}
    assert path.read_text().endswith("\n")
    write_atomic(path, b"\x00\x01", keep_old=True)
    assert path.read_bytes() == b"\x00\x01" and json.loads((tmp_path / "sub" / "a.json.old").read_text()) == {"x": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json", "a.json.old"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = write_atomic(tmp_path / "a.txt", "old")
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_atomic_dir_replaces_a_folder_and_a_failed_one_keeps_it(tmp_path):
    out = tmp_path / "model"
    with atomic_dir(out, mode=0o755) as tmp:
        (tmp / "w").write_text("1")
    assert (out / "w").read_text() == "1" and (out.stat().st_mode & 0o777) == 0o755
    with atomic_dir(out) as tmp:
        (tmp / "v").write_text("2")
    assert [p.name for p in out.iterdir()] == ["v"]  # the old folder replaced, not merged
    with pytest.raises(ValueError), atomic_dir(out) as tmp:
        (tmp / "u").write_text("3")
        raise ValueError("bad")
    assert [p.name for p in out.iterdir()] == ["v"] and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_publish_new_never_replaces_and_create_once_lets_the_first_writer_win(tmp_path):
    names = []
    lock = threading.Lock()

    def writer(i):
        path = publish_new(lambda tmp: tmp.write_text(str(i)), tmp_path, "shard-{:03d}.txt")
        with lock:
            names.append(path.name)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(names) == [f"shard-{i:03d}.txt" for i in range(6)]
    assert sorted(p.read_text() for p in tmp_path.glob("shard-*.txt")) == [str(i) for i in range(6)]
    assert create_once(tmp_path / "meta.json", lambda tmp: tmp.write_text("first")) is True
    assert create_once(tmp_path / "meta.json", lambda tmp: tmp.write_text("second")) is False
    assert (tmp_path / "meta.json").read_text() == "first" and not list(tmp_path.glob(".tmp-*"))
    aside = move_aside(tmp_path / "meta.json", tmp_path / "bad" / "meta.json")
    assert aside.read_text() == "first" and not (tmp_path / "meta.json").exists()


RENAMES = {("os", "replace"), ("os", "rename"), ("os", "renames"), ("os", "link"), ("shutil", "move")}


def publishing_calls(source: str) -> list[int]:
    """Lines of ``source`` that rename or link a file into place: ``os.replace/rename/link``, ``shutil.move``, and a
    path's ``.rename(x)`` / ``.replace(x)`` / ``.link_to(x)`` / ``.hardlink_to(x)`` (one argument: ``str.replace`` takes
    two, a DataFrame's ``rename`` keywords)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        if (owner, node.func.attr) in RENAMES:
            found.append(node.lineno)
        elif node.func.attr in ("rename", "replace", "link_to", "hardlink_to") and len(node.args) == 1 \
                and not node.keywords and owner not in ("os", "shutil"):
            found.append(node.lineno)
    return found


def test_the_check_finds_a_planted_rename():
    planted = ("import os\nos.replace(tmp, out)\ntmp.rename(out)\nPath(t).replace(out)\nos.link(a, b)\n"
               "s.replace('a', 'b')\nframe.rename(columns={'a': 'b'})\n")
    assert publishing_calls(planted) == [2, 3, 4, 5]


def test_every_atomic_write_goes_through_the_one_helper():
    """A file is published only by ``pipeline.files`` (its temp name, its cleanup, its ``.old`` copy in one place)."""
    found = [f"{path.relative_to(PROJECT_ROOT)}:{line}" for root in ("pipeline", "scripts")
             for path in sorted((PROJECT_ROOT / root).rglob("*.py")) if path != HELPER
             for line in publishing_calls(path.read_text())]
    assert not found, "write through pipeline.files (write_atomic, atomic_file, atomic_dir, publish_new): " + ", ".join(found)
