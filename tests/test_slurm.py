"""The label stage as a SLURM array through hydra-submitit-launcher, on a real single-node cluster (issue 26).

The cluster is ``scripts/slurm_local.sh`` (munged, slurmctld, slurmd; partition ``local``). ``.ci/run`` starts it
before ``make test``; when it is not up, the ``slurm_cluster`` fixture starts it itself as root where the SLURM
packages are installed (or anywhere under CI, where the script installs them), and stops what it started. Elsewhere
(not root, no packages, not CI) the tests are skipped with the reason; under CI they fail instead (``require``), so
CI cannot pass them by skipping. ``BLOCKPILOT_NO_SLURM=1`` skips them on purpose, CI included.

The jobs run ``python -m pipeline.label`` with this venv's python on the tiny models of ``tests/test_label.py``
(its fixtures and helpers are reused), one CPU and one thread each, logs under ``<tmp>/submitit/<job id>/``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from conftest import in_ci, require
from pipeline import PROJECT_ROOT
from pipeline.labeling.store import LabelStore, read_labels, read_shard
from test_label import TEXTS, comparable, label_setup, run, write_prompts  # noqa: F401  (label_setup: a fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # slow: each multirun starts python + torch in its jobs

SCRIPT = PROJECT_ROOT / "scripts" / "slurm_local.sh"
PARTITION = os.environ.get("SLURM_LOCAL_PARTITION", "local")


@dataclass
class Cluster:
    conf: str       # SLURM_CONF of the local cluster
    partition: str  # its default partition

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": self.conf}

    def squeue(self, name: str) -> dict[str, str]:
        """{job id (``<array>_<task>``): state} of this user's jobs named ``name`` still in the queue."""
        out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i %T"], env=self.env(), capture_output=True,
                             text=True, check=True, timeout=30).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.fixture(scope="module")
def slurm_cluster():
    """The local SLURM cluster (``scripts/slurm_local.sh``): reused when up, else started here and stopped after."""
    if os.environ.get("BLOCKPILOT_NO_SLURM", "").strip() not in ("", "0"):
        pytest.skip("BLOCKPILOT_NO_SLURM is set")
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True, timeout=60)
    started = False
    if status.returncode != 0:
        require(os.geteuid() == 0, "no local SLURM cluster is up and starting one needs root "
                                   "(sudo scripts/slurm_local.sh start; see docs/scale_out.md)")
        require(in_ci() or shutil.which("slurmctld") is not None,
                "no local SLURM cluster is up and the SLURM packages are not installed; "
                "scripts/slurm_local.sh start installs them (apt) and starts one (docs/scale_out.md)")
        start = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
        require(start.returncode == 0, f"scripts/slurm_local.sh start failed: {start.stderr.strip()[-2000:]}")
        started = True
    conf = subprocess.run(["bash", str(SCRIPT), "env"], capture_output=True, text=True, check=True).stdout.strip()
    cluster = Cluster(conf.split("SLURM_CONF=", 1)[1], PARTITION)
    yield cluster
    if started:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True, timeout=120)


def slurm_multirun(cluster: Cluster, args: list[str], tmp_path: Path, name: str) -> list[str]:
    """``python -m pipeline.label -m label.shard=0,1 label.num_shards=2 hydra/launcher=submitit_slurm ...`` for the
    local cluster: one CPU, no GPU, 1 GB and a 10-minute limit per job; logs in ``tmp_path/submitit/<job id>/``."""
    return [sys.executable, "-m", "pipeline.label", "-m", "label.shard=0,1", "label.num_shards=2",
            "hydra/launcher=submitit_slurm", f"hydra.launcher.partition={cluster.partition}",
            "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
            "hydra.launcher.timeout_min=10", f"hydra.launcher.name={name}",
            f"hydra.launcher.submitit_folder={tmp_path / 'submitit'}/%j", "label.num_threads=1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]


def job_env(cluster: Cluster) -> dict[str, str]:
    """The launcher's environment; sbatch passes it on to the jobs (this checkout first on their path, one thread)."""
    return {**cluster.env(), "PYTHONPATH": str(PROJECT_ROOT), "BLOCKPILOT_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}


def job_logs(tmp_path: Path) -> str:
    """The tail of every job log under ``tmp_path/submitit`` (for failure messages)."""
    logs = sorted((tmp_path / "submitit").glob("**/*.out"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in logs) or "(no job logs)"


def rows_by_file(out: Path) -> dict[str, tuple[bytes, list[str], set[int]]]:
    """{shard file name: (its bytes, its ids, the label shards that wrote it)} of a label directory."""
    files = {}
    for f in LabelStore(out, create=False).shard_files():
        table = read_shard(f, ["id", "shard"])
        files[f.name] = (f.read_bytes(), table.column("id").to_pylist(), set(table.column("shard").to_pylist()))
    return files


def test_slurm_array_shards_equal_one_worker(slurm_cluster, label_setup, tmp_path):
    """Two label shards as a SLURM array (submitit launcher) on the local cluster == one worker, exactly."""
    out = tmp_path / "slurm"
    name = f"bp-label-{uuid.uuid4().hex[:8]}"
    cmd = slurm_multirun(slurm_cluster, label_setup(out), tmp_path, name)
    result = subprocess.run(cmd, cwd=PROJECT_ROOT, env=job_env(slurm_cluster), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{job_logs(tmp_path)}"
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["shard0-of-2", "shard1-of-2"]
    logs = sorted((tmp_path / "submitit").glob("*/*_log.out"))
    assert len(logs) == 2, job_logs(tmp_path)  # one log per array task: <array id>_<task>_0_log.out
    assert [f"shard {i}/2: labelled" in p.read_text() for i, p in enumerate(logs)] == [True, True], job_logs(tmp_path)
    # the one worker decodes on the decoder its config builds, as each shard does (the same backend and draft
    # precision: a fixture's eager decoder drafts on other products)
    run(label_setup(tmp_path / "one"))
    sharded, one = read_labels(out), read_labels(tmp_path / "one")
    assert sorted(set(sharded["shard"])) == [0, 1] and set(sharded["num_shards"]) == {2}
    assert sharded["id"].tolist() == [f"tiny-{i}" for i in range(len(TEXTS))]
    pd.testing.assert_frame_equal(comparable(sharded), comparable(one))


def test_scancel_one_shard_then_rerun_relabels_only_what_it_had_not_written(slurm_cluster, label_setup, tmp_path):
    """``scancel`` one array task mid-shard; rerunning the same multirun leaves every written shard file as it was
    and writes exactly the cancelled shard's missing requests (each request once in the directory)."""
    texts = [f"{text} (variant {k})" for k in range(60) for text in TEXTS]  # 300 prompts, 150 per shard
    prompts = write_prompts(tmp_path / "many.jsonl", texts)
    out = tmp_path / "slurm"
    # one file per request, 64 new tokens: shard 1 takes far longer than a cancel takes to land (~1-8 s here)
    args = label_setup(out, f"data.sets=[{{name:tiny,source:'{prompts}'}}]", "label.flush_every=1",
                       "decode.max_new_tokens=64")
    name = f"bp-label-{uuid.uuid4().hex[:8]}"
    cmd = slurm_multirun(slurm_cluster, args, tmp_path, name)
    shard_ids = {s: {f"tiny-{i}" for i in range(len(texts)) if i % 2 == s} for s in (0, 1)}

    launcher = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=job_env(slurm_cluster), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    cancelled, seen = None, set()
    try:
        deadline = time.monotonic() + 480
        while cancelled is None:  # wait until shard 1 has written its first request, then cancel its job
            assert time.monotonic() < deadline, f"shard 1 wrote nothing in time\n{job_logs(tmp_path)}"
            assert launcher.poll() is None, f"the launcher exited early:\n{launcher.stderr.read()[-3000:]}"
            for f in LabelStore(out, create=False).shard_files():
                if f.name not in seen:
                    seen.add(f.name)
                    if 1 in read_shard(f, ["shard"]).column("shard").to_pylist():
                        task = [j for j in slurm_cluster.squeue(name) if j.endswith("_1")]
                        assert task, f"shard 1's job is not in the queue: {slurm_cluster.squeue(name)}"
                        subprocess.run(["scancel", task[0]], env=slurm_cluster.env(), check=True, timeout=30)
                        cancelled = task[0]
                        break
            time.sleep(0.05)
        while slurm_cluster.squeue(name):  # both jobs leave the queue: shard 0 done, shard 1 cancelled
            assert time.monotonic() < deadline, f"jobs still queued: {slurm_cluster.squeue(name)}"
            time.sleep(0.5)
        # With accounting (sacct) the launcher reports the cancelled job and exits; the local cluster has no
        # accounting database, so submitit cannot learn the state of a job that left no result and keeps waiting.
        try:
            launcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=30)
    assert launcher.returncode != 0  # the multirun did not complete

    before = rows_by_file(out)
    written = {s: [i for _, ids, shards in before.values() if shards == {s} for i in ids] for s in (0, 1)}
    assert sorted(written[0]) == sorted(shard_ids[0]), "shard 0 was not cancelled: it labels all its prompts"
    assert 0 < len(set(written[1])) < len(shard_ids[1]), (
        f"the cancel of {cancelled} should land mid-shard: shard 1 wrote {len(written[1])} of {len(shard_ids[1])}")

    result = subprocess.run(cmd, cwd=PROJECT_ROOT, env=job_env(slurm_cluster), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{job_logs(tmp_path)}"
    after = rows_by_file(out)
    assert {f: after[f][0] for f in before} == {f: b[0] for f, b in before.items()}  # written files untouched
    new = {f: v for f, v in after.items() if f not in before}
    relabelled = [i for _, ids, _ in new.values() for i in ids]
    assert sorted(relabelled) == sorted(shard_ids[1] - set(written[1]))  # exactly the missing ones, each once
    assert all(shards == {1} for _, _, shards in new.values())
    every_row = [i for _, ids, _ in after.values() for i in ids]
    assert sorted(every_row) == sorted(shard_ids[0] | shard_ids[1])  # no request labelled twice, none missing
    assert read_labels(out)["id"].tolist() == sorted(shard_ids[0] | shard_ids[1])
