"""Start and stop vLLM's OpenAI-compatible server (from ``.venv-vllm``, ``make vllm``) as a subprocess.

``VllmServer`` is the one way BlockPilot runs vLLM (``make serve-vllm``, the benchmarks, the eval methods, the tests):

    from pipeline.peers.vllm_server import VllmServer

    with VllmServer(method="dflash", num_speculative_tokens=7, policy="joint", port=8011) as server:
        client = openai.OpenAI(base_url=server.openai_url, api_key="none")
        ...                                   # server.model is the served model's name
        print(server.spec_decode_counters())  # vLLM's /metrics counters of speculative decoding

``method``: ``ar`` (no speculation), ``dflash`` (vLLM's DFlash with our drafter folder, K =
``num_speculative_tokens`` drafts per step), ``ngram`` (vLLM's prompt-lookup proposer: the continuation of the
longest match of the last ``prompt_lookup_min``..``prompt_lookup_max`` tokens in the request's own tokens, up to K) or
``suffix`` (vLLM's suffix decoding, ArcticInference's suffix trees over the request and earlier responses; needs the
``arctic-inference`` package in vLLM's environment). ``policy`` (dflash only): ``off`` (vLLM's own DFlash, every draft
verified), ``fixed``, ``per_request`` or ``joint`` (BlockPilot's plugin: ``pipeline.integrations.vllm.plugin``,
docs/vllm.md). The defaults serve the embedded default: the SmolLM2 target's HF folder (materialized once into
``data/cache/smollm2-135m-instruct`` by ``pipeline.models.target.cache_embedded_target``, which needs ``.venv``),
the shipped drafter and its ``calibration.json``.

On CPU the server runs in float32 with Intel OpenMP preloaded (``LD_PRELOAD`` of ``.venv-vllm/lib/libiomp5.so``,
which vLLM asks for with speculative decoding) and a KV cache of ``kv_cache_gib`` (vLLM's CPU default reserves a
fraction of the node's memory and refuses to start when other processes hold it). ``enforce_eager`` (default)
skips torch.compile (a much faster start). The server's output goes to ``log_path`` (default
``data/runs/vllm/<time>-<port>.log``); a failed start raises with its last lines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import PROJECT_ROOT
from pipeline.peers.vllm_settings import METHODS, Settings, check_server

VENV = PROJECT_ROOT / ".venv-vllm"
EMBEDDED_TARGET = "smollm2-135m-instruct"
SHIPPED_DRAFTER = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def venv_python(venv: str | Path | None = None) -> Path:
    """The Python of vLLM's environment (``.venv-vllm`` of this checkout by default).

    Raises:
        FileNotFoundError: when it is not there (names ``make vllm``).
    """
    python = Path(venv or VENV) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no vLLM environment at {python.parent.parent}: create it with `make vllm`")
    return python


def target_folder(target: str | None = None) -> Path:
    """The HF folder vLLM loads: the embedded default's dequantized cache (made once), or ``target`` itself."""
    if target in (None, EMBEDDED_TARGET):
        from pipeline.models.target import cache_embedded_target

        return Path(cache_embedded_target())
    path = Path(target)
    return path if path.is_absolute() or not (PROJECT_ROOT / path).exists() else PROJECT_ROOT / path


def free_port(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, int(port))) != 0


@dataclass
class VllmServer:
    """vLLM's OpenAI server as a subprocess (see the module docstring).

    Attributes (options):
        method: ``ar``, ``dflash``, ``ngram`` or ``suffix``; num_speculative_tokens: K, the most drafts a step
            verifies (vLLM's ``num_speculative_tokens``); prompt_lookup_min / prompt_lookup_max: ``ngram``'s match
            lengths (vLLM's fields of those names).
        policy: the plugin's policy for dflash: ``off`` (vLLM alone), ``fixed``, ``per_request``, ``joint``.
        host, port: where it listens (loopback by default); max_num_seqs: vLLM's concurrent requests.
        enforce_eager: no torch.compile (fast start); dtype: the models' dtype; max_model_len: the context.
        target: the target's HF folder (default: the embedded SmolLM2's); drafter: the drafter folder (default:
            the shipped one); served_model_name: the ``model`` of requests (default ``smollm2-135m-instruct`` for the
            embedded target, else the folder's name).
        calibration, labels, cache_dir, margin, max_skip, explore, save_every_s: the plugin's settings
            (``pipeline.peers.vllm_settings``; None: their defaults).
        kv_cache_gib: the KV cache vLLM allocates (GiB); preload_iomp: preload Intel OpenMP (CPU).
        prefix_caching: vLLM's prefix caching. In vLLM 0.32 a dflash server never hits its prefix cache (observed:
            0% hits on repeated prompts, where ar hits about half), so method comparisons on repeated prompts turn
            it off for every method (False) or send each prompt once.
        per_request_metrics: ``--per-request-spec-decode-metrics`` of dflash (``detailed``: each response's
            per-step drafted/accepted counts; ``none`` to leave them out).
        shutdown_timeout_s: vLLM's ``--shutdown-timeout``: how long a stopping server lets in-flight requests finish
            and its engine and worker exit before it kills them. vLLM's default (0) kills the engine and the worker at
            once, in the same instant as the stop signal reaches the worker, whose plugin saves its learned step
            costs then (``pipeline.integrations.vllm.runtime``): a few seconds let that save finish on a busy machine.
        seed: vLLM's seed; extra_args: more ``vllm serve`` arguments; env: more environment variables.
        venv: vLLM's environment (default ``.venv-vllm``); log_path: the server's log file;
        startup_timeout_s: how long ``start`` waits for ``/health``; progress: print the wait's progress to stderr.
    Raises:
        ValueError: from the constructor, for an unknown method or policy, K < 1, or a policy with ``ar``.
    """

    method: str = "dflash"
    num_speculative_tokens: int = 7
    policy: str = "off"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 16
    enforce_eager: bool = True
    dtype: str = "float32"
    max_model_len: int = 2048
    target: str | None = None
    drafter: str | None = None
    served_model_name: str | None = None
    calibration: str | None = None
    labels: str | None = None
    cache_dir: str | None = None
    margin: float | None = None
    max_skip: int | None = None
    explore: int | None = None
    save_every_s: float | None = None
    kv_cache_gib: float = 1.0
    preload_iomp: bool = True
    prefix_caching: bool = True
    per_request_metrics: str = "detailed"
    shutdown_timeout_s: int = 5
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    venv: str | None = None
    log_path: str | None = None
    startup_timeout_s: float = 900.0
    progress: bool = True

    def __post_init__(self) -> None:
        check_server(self.method, self.policy, self.num_speculative_tokens)
        self.process: subprocess.Popen | None = None
        self._log = None

    # ------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def openai_url(self) -> str:
        """The OpenAI client's ``base_url``."""
        return f"{self.url}/v1"

    @property
    def model(self) -> str:
        """The served model's name (the ``model`` field of requests)."""
        if self.served_model_name:
            return self.served_model_name
        return EMBEDDED_TARGET if self.target in (None, EMBEDDED_TARGET) else Path(self.target).name

    def settings(self) -> Settings:
        """The plugin's settings this server runs with."""
        defaults = Settings()
        return Settings(policy=self.policy if self.method == "dflash" else "off", calibration=self.calibration,
                        cache_dir=self.cache_dir, labels=self.labels,
                        margin=defaults.margin if self.margin is None else float(self.margin),
                        max_skip=defaults.max_skip if self.max_skip is None else int(self.max_skip),
                        explore=defaults.explore if self.explore is None else int(self.explore),
                        save_every_s=defaults.save_every_s if self.save_every_s is None else float(self.save_every_s))

    def command(self, target: str | Path | None = None) -> list[str]:
        """The server's command line (``target``: the target folder, default ``target_folder(self.target)``)."""
        target = target or target_folder(self.target)
        cmd = [str(venv_python(self.venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
               "--served-model-name", self.model, "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", str(self.max_num_seqs), "--seed", str(self.seed),
               "--kv-cache-memory-bytes", str(int(self.kv_cache_gib * (1 << 30))),
               "--shutdown-timeout", str(int(self.shutdown_timeout_s)),
               "--generation-config", "vllm"]  # requests' defaults are vLLM's, not the checkpoint's
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        spec = {"method": self.method, "num_speculative_tokens": int(self.num_speculative_tokens)}
        if self.method == "dflash":
            drafter = Path(self.drafter) if self.drafter else SHIPPED_DRAFTER
            spec["model"] = str(drafter if drafter.is_absolute() else PROJECT_ROOT / drafter)
        elif self.method == "ngram":
            spec.update(prompt_lookup_min=int(self.prompt_lookup_min), prompt_lookup_max=int(self.prompt_lookup_max))
        if self.method != "ar":
            cmd += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", self.per_request_metrics]
        return cmd + [str(a) for a in self.extra_args]

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, the plugin's settings, Intel OpenMP preloaded, offline hubs."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKPILOT_VLLM_")}
        env.update(self.settings().to_env())
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
        iomp = Path(venv_python(self.venv)).parent.parent / "lib" / "libiomp5.so"
        if self.preload_iomp and iomp.exists() and "libiomp" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
        env.update({k: str(v) for k, v in self.env.items()})
        return env

    # ------------------------------------------------------------------------------------------------
    def start(self) -> "VllmServer":
        """Start the server and wait until ``/health`` answers (progress on stderr every 15 s).

        Raises:
            RuntimeError: when the port is taken, when the server exits before it is healthy (with its log's last
                lines), or after ``startup_timeout_s`` without health (the server is stopped).
            FileNotFoundError: without ``.venv-vllm`` (``make vllm``).
        """
        if self.process is not None:
            raise RuntimeError(f"the vLLM server on {self.url} is already started")
        if not free_port(self.host, self.port):
            raise RuntimeError(f"{self.host}:{self.port} is taken: pick another port (port=...)")
        command = self.command()
        log_path = Path(self.log_path) if self.log_path else \
            PROJECT_ROOT / "data" / "runs" / "vllm" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{self.port}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = str(log_path)
        self._log = open(log_path, "ab")
        self._log.write(("$ " + " ".join(command) + "\n").encode())
        self._log.flush()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=self.environment(), cwd=str(PROJECT_ROOT), start_new_session=True)
        t0 = last = time.monotonic()
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise RuntimeError(f"the vLLM server exited with code {code} before it was healthy; its log "
                                   f"({log_path}) ends:\n{self.log_tail()}")
            if self.healthy():
                if self.progress:
                    print(f"[vllm] {self.url} healthy after {time.monotonic() - t0:.0f} s (log {log_path})",
                          file=sys.stderr, flush=True)
                return self
            now = time.monotonic()
            if now - t0 > self.startup_timeout_s:
                self.stop()
                raise RuntimeError(f"the vLLM server on {self.url} was not healthy after {self.startup_timeout_s:.0f} s "
                                   f"(startup_timeout_s); its log ({log_path}) ends:\n{self.log_tail()}")
            if self.progress and now - last >= 15:
                last = now
                lines = self.log_tail(1).strip()
                print(f"[vllm] waiting for {self.url}/health ({now - t0:.0f} s): {lines[-160:]}", file=sys.stderr,
                      flush=True)
            time.sleep(1.0)

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and its engine/worker processes (SIGTERM to its process group, SIGKILL after
        ``timeout_s``); a no-op when it is not running."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
        if process is not None:
            try:  # engine or worker processes left in the group (the server itself already gone)
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log."""
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200 * lines))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def spec_decode_counters(self) -> dict[str, float]:
        """vLLM's speculative-decoding counters from ``/metrics`` (``SPEC_COUNTERS``, summed over label sets; absent
        ones are 0).

        Raises:
            urllib.error.URLError: when the server does not answer.
        """
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        return parse_counters(text, SPEC_COUNTERS)

    def serve_forever(self) -> None:
        """Start, then wait until the server exits or the caller is interrupted (Ctrl-C); stops it either way."""
        self.start()
        try:
            while self.process is not None and self.process.poll() is None:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()


def parse_counters(text: str, names) -> dict[str, float]:
    """Prometheus text -> {name: the sum of its samples} for ``names`` (0 for a name without samples)."""
    out = {name: 0.0 for name in names}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        metric, _, value = line.rpartition(" ")
        name = metric.split("{", 1)[0]
        if name in out:
            try:
                out[name] += float(value)
            except ValueError:
                continue
    return out
