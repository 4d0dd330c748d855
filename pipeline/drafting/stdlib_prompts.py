"""Code-completion prompts the project builds itself from the Python standard library.

Each prompt shows a documented stdlib function's signature and docstring (body removed) and asks for
the whole function, in the same wording as the HumanEval requests of ``pipeline.prompts``. They widen
the drafter's code data without touching any evaluation set.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

from pipeline.prompts import HUMANEVAL_INSTRUCTION, Prompt


def _function_stub(source: str, node: ast.FunctionDef) -> str | None:
    doc = ast.get_docstring(node, clean=True)
    if not doc or len(doc) < 40 or node.name.startswith("_"):
        return None
    header = ast.get_source_segment(source, node)
    if header is None:
        return None
    signature = header.split("\n")[0]
    if not signature.rstrip().endswith(":") or len(signature) > 160:
        return None
    doc_lines = doc.strip().split("\n")[:12]
    body = "\n".join(("    " + line) if line.strip() else "" for line in doc_lines)
    return f'{signature}\n    """\n{body}\n    """\n'


def stdlib_prompts(limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """HumanEval-style prompts from documented top-level functions of the stdlib (tests excluded).

    Args:
        limit: keep at most this many (after a seeded shuffle).
    Returns:
        prompts with ids ``stdlib-<module>-<function>`` and source set ``stdlib``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts, seen = [], set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo"} for part in rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name not in seen:
                stub = _function_stub(source, node)
                if stub:
                    seen.add(node.name)
                    prompts.append(Prompt(f"stdlib-{module}-{node.name}", [HUMANEVAL_INSTRUCTION.format(prompt=stub)], "stdlib"))
    random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit else prompts
