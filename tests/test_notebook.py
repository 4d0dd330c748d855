"""notebooks/analysis.ipynb runs headless (nbclient) on a tiny pipeline run and draws every figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).parent))
from policy_fixtures import CANDIDATES, build_tiny_run  # noqa: E402

from pipeline import PROJECT_ROOT  # noqa: E402

NOTEBOOK = PROJECT_ROOT / "notebooks" / "analysis.ipynb"


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory) -> dict:
    return build_tiny_run(tmp_path_factory.getbasetemp() / "policy-run", tiny.target_dir("llama"), tiny.drafter_dir("llama", "trained"))


def execute(monkeypatch, **env: str):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def outputs(nb, kind: str) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if kind in o.get("data", {})]


def test_notebook_is_valid_with_a_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert "parameters" in nb.cells[1].metadata.get("tags", [])
    assert "BLOCKPILOT_LABELS_DIR" in nb.cells[1].source and "BLOCKPILOT_RESULTS" in nb.cells[1].source


def test_notebook_draws_the_figures_on_a_tiny_run(run, monkeypatch, tmp_path):
    results = json.loads(Path(run["results"]).read_text())
    # On the tiny run's few test prompts the oracle may gain nothing over fixed, and the share is then undefined
    # (null): give blockpilot a known share and interval in a copy, so that the sentence is checked on every run.
    results["methods"]["blockpilot"].update(oracle_gain_share=0.25, oracle_gain_share_ci=[0.1, 0.4])
    constructed = tmp_path / "results.json"
    constructed.write_text(json.dumps(results))
    nb = execute(monkeypatch, BLOCKPILOT_LABELS_DIR=run["labels"], BLOCKPILOT_RESULTS=str(constructed))
    images = outputs(nb, "image/png")
    # tau curves (absolute, normalised), optimal-B histogram, speedup bars, two confusion matrices
    assert len(images) == 6, len(images)
    text = "\n".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert f"12 labelled prompts from 2 sets, candidates {CANDIDATES}" in text
    assert f"eval: {len(results['methods'])} methods on the test prompts" in text
    assert "blockpilot: recovers 25% of the oracle's tau gain over fixed (95% CI 10%..40%)" in text
    markdown = "\n".join(o["data"]["text/markdown"] for o in outputs(nb, "text/markdown"))
    assert "| blockpilot † |" in markdown and "Source set `math`" in markdown  # †: a tiny run has < 10 requests
