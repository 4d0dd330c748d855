"""BlockPilot's vLLM plugin, its pure parts (no vLLM needed): the settings and the per-request opt-out, the version
check, the learned step costs, the width choice from the drafter's probabilities and a cost curve, the drafter gate,
the label rows and the calibration refit, the launcher's command line. The plugin in a running vLLM:
tests/test_vllm.py (marked ``vllm``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeline import PROJECT_ROOT
from pipeline.costs import store
from pipeline.integrations.vllm.costs import StepCosts, cache_key
from pipeline.integrations.vllm.labels import LabelLog, read_rows, refit, step_row
from pipeline.integrations.vllm.policy import YIELD_DECAY, StepPolicy
from pipeline.integrations.vllm.runtime import accepted_drafts
from pipeline.peers.vllm_server import VllmServer, parse_counters
from pipeline.peers.vllm_settings import Settings, check_vllm_version, speculates
from pipeline.costs.margin import GATE_MARGIN
from pipeline.policy.calibration import AcceptanceCalibration, load_calibration
from pipeline.policy.widths import best_width, brute_force_allocate

SHIPPED = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"
K = 7


def _imports_of(module: str) -> set[str]:
    """Top-level packages a fresh interpreter has loaded after importing ``module``."""
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
    return set(out.stdout.split())


def test_the_plugin_module_loads_no_model_code():
    """vLLM imports the entry point in every process (its API server too): no torch, transformers or vLLM at import."""
    assert not {"torch", "transformers", "vllm"} & _imports_of("pipeline.integrations.vllm.plugin")
    # what the worker-side hooks import (vLLM's own modules only when installed in vLLM's process): torch and our
    # light policy core, no transformers or model code
    loaded = _imports_of("pipeline.integrations.vllm.runtime")
    assert "torch" in loaded and not {"transformers", "vllm", "pandas"} & loaded


def test_settings_from_the_environment():
    assert Settings.from_env({}) == Settings() and not Settings().active
    s = Settings.from_env({"BLOCKPILOT_VLLM_POLICY": "Joint", "BLOCKPILOT_VLLM_MARGIN": "0.2",
                           "BLOCKPILOT_VLLM_MAX_SKIP": "4", "BLOCKPILOT_VLLM_LABELS": "/tmp/x.jsonl",
                           "BLOCKPILOT_VLLM_SAVE_EVERY_S": "0"})
    assert s.active and (s.policy, s.margin, s.max_skip, s.labels) == ("joint", 0.2, 4, "/tmp/x.jsonl")
    assert Settings().margin == GATE_MARGIN == 0.1  # the one margin of every gate
    assert s.save_every_s == 0.0 and Settings().save_every_s == 5.0  # 0: the step costs are saved only at stop
    assert Settings.from_env(s.to_env()) == s
    # the plugin's policies' names before issue 41 are the registry's names of other methods: refused, naming the new
    for old, new in (("verify_width", "per_request"), ("budget", "joint")):
        with pytest.raises(ValueError, match=rf"BLOCKPILOT_VLLM_POLICY='{old}': the plugin's '{old}' is now '{new}'"):
            Settings.from_env({"BLOCKPILOT_VLLM_POLICY": old})
        with pytest.raises(ValueError, match=rf"is now '{new}'"):
            VllmServer(method="dflash", policy=old)
        with pytest.raises(ValueError, match=rf"is now '{new}'"):
            StepPolicy(old, None, StepCosts(), K)
    with pytest.raises(ValueError, match="BLOCKPILOT_VLLM_POLICY='greedy' is not one of"):
        Settings.from_env({"BLOCKPILOT_VLLM_POLICY": "greedy"})
    with pytest.raises(ValueError, match="BLOCKPILOT_VLLM_MAX_SKIP='two' is not a int"):
        Settings.from_env({"BLOCKPILOT_VLLM_MAX_SKIP": "two"})
    with pytest.raises(ValueError, match="BLOCKPILOT_VLLM_MARGIN='-1' must be >= 0"):
        Settings.from_env({"BLOCKPILOT_VLLM_MARGIN": "-1"})
    with pytest.raises(ValueError, match="BLOCKPILOT_VLLM_SAVE_EVERY_S='-5' must be >= 0"):
        Settings.from_env({"BLOCKPILOT_VLLM_SAVE_EVERY_S": "-5"})


def test_a_request_opts_out_of_speculation():
    assert speculates(None) and speculates({}) and speculates({"other": 1})
    assert not speculates({"blockpilot_speculate": False}) and speculates({"blockpilot_speculate": True})
    assert not speculates({"blockpilot_speculate": "false"}) and not speculates({"blockpilot_speculate": 0})
    with pytest.raises(ValueError, match="blockpilot_speculate='maybe' must be true or false"):
        speculates({"blockpilot_speculate": "maybe"})


def test_the_version_check_names_the_series_and_the_way_out():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3+cpu")
    for version in ("0.33.0", "0.31.2", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"internals of vLLM 0\.32\.x .*this is vLLM {version}.*make vllm.*POLICY=off"):
            check_vllm_version(version)


# ---------------------------------------------------------------------------------------------------
# the learned step costs
# ---------------------------------------------------------------------------------------------------
def _costs(verify_base=50.0, per_token=1.0, draft=10.0, idle=1.0, overhead=2.0, requests=(1, 2, 4, 16), samples=3):
    """A StepCosts filled as a server would fill it: verify(T) = base + per_token * T, constant drafter costs."""
    costs = StepCosts()
    for _ in range(samples):
        for n in requests:
            for k in range(K + 1):
                costs.add("verify", n * (1 + k), verify_base + per_token * n * (1 + k))
            costs.add("draft", n, draft + 0.5 * n)
            costs.add("idle", n, idle)
            costs.add("overhead", n, overhead)
    return costs


def test_step_costs_fit_medians_monotone_and_round_trip(tmp_path):
    costs = StepCosts(keep=3)
    for ms in (10.0, 11.0, 100.0, 12.0):  # the oldest sample (10) falls out; the median ignores the outlier (100)
        costs.add("verify", 4, ms)
    costs.add("verify", 8, 5.0)  # a noisy, cheaper wider step: pooled, so 8 rows never cost less than 4
    xs, ys = costs.curve("verify")
    assert xs == [4, 8] and ys[0] == ys[1] and ys[0] == pytest.approx((12.0 + 5.0) / 2)
    assert costs.at("verify", 6) == pytest.approx(ys[0]) and costs.at("draft", 3) == 0.0
    costs.add("draft", 2, 7.0)
    costs.add("overhead", 2, 1.0)
    assert costs.step_ms(8, 2, drafted=True) == pytest.approx(ys[1] + 1.0 + 7.0)
    assert costs.missing(2, range(3), enough=1) == {"verify": [0, 2], "draft": [], "idle": [2]}
    key = cache_key(vllm="0.32.0", target="t", drafter="d", k=7)
    assert key["kind"] == "step-costs" and key["k"] == "7" and key["host"] == store.host()  # the one key builder
    path = costs.store(tmp_path, key)  # the one cache's file and writer
    assert path == store.path_of(tmp_path, key) and path.name.startswith("step-costs-") and costs.added == 0
    assert json.loads(path.read_text())["key"] == key
    loaded = StepCosts.stored(tmp_path, key)
    assert loaded.curve("verify") == costs.curve("verify") and loaded.count("verify", 4) == 3
    assert StepCosts.load(path).curve("verify") == costs.curve("verify")
    other = cache_key(vllm="0.32.0", target="t", drafter="d", k=6)
    assert StepCosts.stored(tmp_path, other).info == other and not StepCosts.stored(tmp_path, other).tables["verify"]
    with pytest.raises(ValueError, match="step-cost table must be one of"):
        costs.add("prefill", 1, 1.0)


# ---------------------------------------------------------------------------------------------------
# the width choice
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def calibration() -> AcceptanceCalibration:
    return load_calibration(SHIPPED) if (SHIPPED / "calibration.json").exists() else \
        AcceptanceCalibration([0.0] * 8, [1.0] * 8)


def _confidence(*rows):
    return torch.tensor([list(r) + [r[-1]] * (K - len(r)) for r in rows], dtype=torch.float32)


def test_joint_widths_are_the_joint_optimum(calibration):
    costs = _costs(requests=(3,))
    policy = StepPolicy("joint", calibration, costs, K)
    confidence = _confidence([0.99, 0.98, 0.95, 0.9, 0.3], [0.9, 0.4, 0.1], [0.05, 0.02])
    ids = ["a", "b", "c"]
    assert policy.plan(ids, [True] * 3) == K
    widths = policy.widths(ids, [True] * 3, confidence)
    acceptance = [calibration.predict(confidence[i].double()) for i in range(3)]
    expected, _ = brute_force_allocate([a[:4] for a in acceptance], lambda rows: costs.step_ms(rows, 3, True))
    assert widths[0] >= widths[1] >= widths[2] == 0  # confident drafts are verified, hopeless ones are not
    assert [min(w, 4) for w in widths] == expected  # = brute force over the first 4 columns (small enough to enumerate)
    # opted out: never verified, whatever its drafts; its row still counts in the step's cost
    assert policy.widths(ids, [True, True, False], confidence)[2] == 0


def test_per_request_prices_each_request_at_its_share(calibration):
    costs = _costs(requests=(2,))
    policy = StepPolicy("per_request", calibration, costs, K)
    confidence = _confidence([0.99, 0.97, 0.9, 0.6], [0.2, 0.1])
    policy.plan(["a", "b"], [True, True])
    widths = policy.widths(["a", "b"], [True, True], confidence)
    for i in range(2):
        verify = [costs.at("overhead", 2) / 2 + costs.at("verify", 2 * (1 + k)) / 2 for k in range(K + 1)]
        k, _ = best_width(calibration.predict(confidence[i].double()), costs.at("draft", 2) / 2, verify)
        assert widths[i] == k
    assert widths[0] > widths[1]


def test_fixed_verifies_every_draft_except_opted_out(calibration):
    policy = StepPolicy("fixed", None, StepCosts(), K)
    assert policy.plan(["a", "b"], [True, False]) == K  # never explores: no cost curve needed
    assert policy.widths(["a", "b"], [True, False], _confidence([0.01], [0.99])) == [K, 0]
    assert policy.plan(["b"], [False]) == 0  # nobody speculates: no drafts at all


def test_the_gate_skips_the_drafter_where_it_does_not_pay_and_probes(calibration):
    cheap = _costs(per_token=0.1, draft=1.0, requests=(1,))
    dear = _costs(per_token=20.0, draft=40.0, requests=(16,))
    policy = StepPolicy("joint", calibration, cheap, K, max_skip=4)
    assert policy.plan(["a"], [True]) == K  # nothing known: drafts to learn
    policy.widths(["a"], [True], _confidence([0.9, 0.8, 0.7]))
    assert policy.plan(["a"], [True]) == K  # drafting pays on a cheap verify
    ids = [f"r{i}" for i in range(16)]
    policy = StepPolicy("joint", calibration, dear, K, max_skip=4)
    assert policy.plan(ids, [True] * 16) == K  # the first step learns the population's acceptance
    policy.widths(ids, [True] * 16, _confidence(*[[0.5, 0.3]] * 16))
    plans = [policy.plan(ids, [True] * 16) for _ in range(10)]
    # a step's drafts cannot repay a 40 ms drafter at 20 ms per verified row: no drafter, except the probes that
    # refresh the priors after 1, 2, 4, 4 ... skipped steps
    assert plans == [0, K, 0, 0, K, 0, 0, 0, 0, K] and policy.decisions["probes"] == 3
    # a probe whose drafts, as verified, pay (here: certain drafts on a cheaper step) starts the runs again from 1
    policy.costs = _costs(per_token=0.1, draft=1.0, requests=(16,))
    policy.widths(ids, [True] * 16, _confidence(*[[0.999] * K] * 16))
    policy.costs = dear
    policy.core.requests.clear()
    policy.core.population = torch.full((K,), 0.05, dtype=torch.float64)
    assert [policy.plan(ids, [True] * 16) for _ in range(4)] == [0, K, 0, 0]
    assert StepPolicy("joint", calibration, dear, K, max_skip=0).plan(ids, [False] * 16) == 0


def test_the_rejection_samplers_output_gives_each_requests_accepted_drafts():
    sampled = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [1, 2, 3, 4], [9, -1, -1, -1]])
    assert accepted_drafts(sampled, [3, 3, 3, 0], 4) == [1, 0, 3, None]  # kept tokens - the bonus; none verified
    assert accepted_drafts([[5, 6], [7], [1, 2, 3, 4], [9]], [3, 3, 3, 0], 4) == [1, 0, 3, None]


def test_the_drafted_yield_stops_a_drafter_that_the_calibration_overrates(calibration):
    """The gate drafts on the calibration's promise; when vLLM's verifies accept fewer drafts than it promised, the
    yield (accepted / expected) scales the promise down and the drafter stops, except for the probes."""
    ids = [f"r{i}" for i in range(16)]
    confident = _confidence(*[[0.9] * K] * 16)

    def run(accepts):
        policy = StepPolicy("joint", calibration, _costs(per_token=1.0, draft=10.0, requests=(16,)), K, max_skip=8)
        plans, widths = [], []
        for _ in range(20):
            plans.append(policy.plan(ids, [True] * 16))
            w = policy.widths(ids, [True] * 16, confident if plans[-1] else None)
            if plans[-1]:
                widths.append(w)
                expected = dict(policy._expected)
                policy.observe(ids, [accepts(expected[r], w[i]) for i, r in enumerate(ids)])
        return policy, plans, widths

    kept, plans, widths = run(lambda expected, k: min(k, round(expected)))  # the calibration holds: it keeps drafting
    assert plans == [K] * 20 and 0.8 < kept.drafted_yield < 1.2
    overrated, plans, widths = run(lambda expected, k: 0)  # no draft is ever accepted
    assert overrated.drafted_yield == 0.0
    assert plans[:6] == [K, 0, K, 0, 0, K] and plans.count(K) <= 5  # the first step, then only the probes
    # the yield is the decayed ratio of accepted to expected drafts, trusted from 4 expected ones
    policy = StepPolicy("joint", calibration, _costs(requests=(16,)), K)
    policy._expected = {"a": 3.0, "b": 2.0}
    policy.observe(["a", "b", "c"], [1, 1, None])
    assert policy.drafted_yield == pytest.approx(2 / 5)
    policy._expected = {"a": 1.0}
    policy.observe(["a"], [1])
    assert policy.drafted_yield == pytest.approx((YIELD_DECAY * 2 + 1) / (YIELD_DECAY * 5 + 1))
    fresh = StepPolicy("joint", calibration, _costs(requests=(16,)), K)
    fresh._expected = {"a": 3.0}
    fresh.observe(["a"], [0])
    assert fresh.drafted_yield == 1.0  # 3 expected drafts are too few to judge the calibration by


def test_the_policy_explores_missing_costs(calibration):
    costs = StepCosts()
    policy = StepPolicy("joint", calibration, costs, K, explore=1)
    assert policy.plan(["a"], [True]) == 0  # first a plain step (verify(1), the idle drafter)
    costs.add("verify", 1, 50.0)
    costs.add("idle", 1, 1.0)
    assert policy.plan(["a"], [True]) == K  # then drafting steps, every request verifying the same width:
    assert policy.widths(["a"], [True], _confidence([0.01])) == [1]  # the narrowest one still missing, whatever p
    for k in range(1, K + 1):
        costs.add("verify", 1 + k, 50.0 + k)
    costs.add("draft", 1, 5.0)
    policy.plan(["a"], [True])
    assert policy.decisions["explored"] == 2
    with pytest.raises(ValueError, match="rows for 1 requests"):
        policy.widths(["a"], [True], _confidence([0.5], [0.5]))
    with pytest.raises(ValueError, match="needs an acceptance calibration"):
        StepPolicy("joint", None, costs, K)


# ---------------------------------------------------------------------------------------------------
# labels from vLLM traffic
# ---------------------------------------------------------------------------------------------------
def test_step_rows_hold_the_judged_columns(tmp_path):
    p = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    row = step_row("r1", 5, 8, p, verified=4, accepted=2)  # drafts 1, 2 accepted, 3 rejected, 4 never judged
    assert (row["conf_column"], row["conf_ok"], row["conf_p"]) == ([1, 2, 3], [True, True, False], p[:3])
    assert row["conf_block"] == [8, 8, 8] and row["source_set"] == "vllm" and row["id"] == "r1"
    assert step_row("r1", 6, 8, p, 3, 3)["conf_ok"] == [True] * 3  # all accepted: no rejection to record
    assert step_row("r1", 7, 8, p, 0, 0) is None
    with pytest.raises(ValueError, match="accepted .3. <= verified .2."):
        step_row("r1", 8, 8, p, 2, 3)


def test_refit_from_vllm_labels(tmp_path):
    gen = torch.Generator().manual_seed(0)
    log = LabelLog(tmp_path / "logs" / "labels.jsonl")
    rows = []
    for step in range(400):  # drafts accepted with probability p: a calibrated drafter
        p = torch.rand(K, generator=gen).tolist()
        accepted = 0
        while accepted < K and float(torch.rand(1, generator=gen)) < p[accepted]:
            accepted += 1
        rows.append(step_row(f"r{step % 7}", step, K + 1, p, K, accepted))
    log.write(rows[:200])
    log.write(rows[200:])
    assert log.rows == 400 and len(read_rows([tmp_path / "logs"])) == 400
    path = refit([tmp_path / "logs" / "labels.jsonl"], tmp_path / "out")
    fitted = load_calibration(path)
    assert path.name == "calibration.json" and fitted.info["rows"] == 400
    a = fitted.predict(torch.tensor([0.1, 0.9]), torch.tensor([1, 1]))
    assert a[0] < 0.3 < 0.7 < a[1]  # it learned that p is the acceptance probability
    with pytest.raises(FileNotFoundError, match="BLOCKPILOT_VLLM_LABELS"):
        refit([tmp_path / "nothing.jsonl"], tmp_path / "out")


# ---------------------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------------------
def test_the_launcher_command_and_environment(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").touch()
    monkeypatch.setenv("BLOCKPILOT_VLLM_POLICY", "fixed")  # the caller's own setting does not leak in
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    server = VllmServer(policy="joint", num_speculative_tokens=3, port=8011, venv=str(venv), labels="/tmp/l.jsonl",
                        save_every_s=0)
    cmd = server.command(target="/models/t")
    assert cmd[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 3 and spec["model"] == str(SHIPPED)
    assert cmd[cmd.index("--port") + 1] == "8011" and "--enforce-eager" in cmd and cmd[cmd.index("--model") + 1] == "/models/t"
    assert cmd[cmd.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    assert int(cmd[cmd.index("--shutdown-timeout") + 1]) > 0  # the worker saves its step costs before it is killed
    env = server.environment()
    assert env["BLOCKPILOT_VLLM_POLICY"] == "joint" and env["BLOCKPILOT_VLLM_LABELS"] == "/tmp/l.jsonl"
    assert Settings.from_env(env).save_every_s == 0.0
    assert env["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so") and env["HF_HUB_OFFLINE"] == "1"
    ar = VllmServer(method="ar", venv=str(venv))
    assert "--speculative-config" not in ar.command(target="/models/t")
    assert ar.environment()["BLOCKPILOT_VLLM_POLICY"] == "off" and ar.model == "smollm2-135m-instruct"
    with pytest.raises(ValueError, match="vllm.policy=joint applies to dflash"):
        VllmServer(method="ar", policy="joint")
    ngram = VllmServer(method="ngram", num_speculative_tokens=5, venv=str(venv)).command(target="/models/t")
    assert json.loads(ngram[ngram.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    suffix = VllmServer(method="suffix", num_speculative_tokens=6, venv=str(venv)).command(target="/models/t")
    assert json.loads(suffix[suffix.index("--speculative-config") + 1]) == {"method": "suffix", "num_speculative_tokens": 6}
    with pytest.raises(ValueError, match="vllm.policy=fixed applies to dflash"):
        VllmServer(method="ngram", policy="fixed")
    with pytest.raises(ValueError, match="ngram drafts K >= 1"):
        VllmServer(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="method must be one of"):
        VllmServer(method="eagle")
    with pytest.raises(FileNotFoundError, match="make vllm"):
        VllmServer(venv=str(tmp_path / "none")).command(target="/models/t")


STOPPED_BY_SIGNAL = """
import os, signal, sys, time
from pipeline.integrations.vllm.runtime import save_on_stop_signals

class Controller:  # what the hooks call: stop(why) saves the learned step costs
    def stop(self, why):
        with open(sys.argv[1], "a") as f:
            f.write(why + "\\n")

if sys.argv[2] == "vllm":  # the handler vLLM's worker installs first: SystemExit, then Worker.shutdown
    def worker_handler(signum, frame):
        raise SystemExit(3)
    signal.signal(signal.SIGTERM, worker_handler)
assert save_on_stop_signals(Controller())
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
"""


@pytest.mark.parametrize("before, code", [("vllm", 3), ("default", -15)])
def test_a_stop_signal_saves_the_step_costs_then_does_what_it_did(tmp_path, before, code):
    """vLLM stops its workers by SIGTERM (a forked worker then leaves by os._exit: no atexit): the plugin saves first,
    then the handler that was there runs (vLLM's: SystemExit and the worker's shutdown; none: the process ends by the
    signal, as it would have)."""
    import threading

    from pipeline.integrations.vllm.runtime import save_on_stop_signals

    saved = tmp_path / "saved.txt"
    result = subprocess.run([sys.executable, "-c", STOPPED_BY_SIGNAL, str(saved), before], capture_output=True,
                            text=True, timeout=120, cwd=PROJECT_ROOT)
    assert result.returncode == code, result.stderr[-2000:]
    assert saved.read_text() == "signal SIGTERM\n"
    answers = []  # off the main thread no handler can be set: nothing changes
    thread = threading.Thread(target=lambda: answers.append(save_on_stop_signals(object())))
    thread.start()
    thread.join()
    assert answers == [False]


def test_metrics_counters_are_summed_over_labels():
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0
"""
    got = parse_counters(text, ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                                "vllm:spec_decode_num_accepted_tokens_total"])
    assert got == {"vllm:spec_decode_num_drafts_total": 12.0, "vllm:spec_decode_num_draft_tokens_total": 42.0,
                   "vllm:spec_decode_num_accepted_tokens_total": 0.0}


def test_serve_vllm_config_builds_the_launcher(compose_config, tmp_path):
    from pipeline.serve_vllm import server_of

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    server = server_of(compose_config("serve_vllm", [f"+vllm.venv={venv}", "vllm.port=8013"]))
    assert (server.method, server.policy, server.num_speculative_tokens, server.port) == ("dflash", "joint", 7, 8013)
    spec = json.loads(server.command(target="/t")[server.command(target="/t").index("--speculative-config") + 1])
    assert spec["model"] == str(SHIPPED)  # the config's relative drafter path, from the checkout's root


def test_a_policy_without_a_calibration_names_the_setting(tmp_path):
    from pipeline.integrations.vllm.runtime import calibration_of

    assert calibration_of(Settings(policy="fixed"), str(tmp_path)) is None  # fixed chooses no widths
    with pytest.raises(FileNotFoundError, match="BLOCKPILOT_VLLM_CALIBRATION.*make vllm-refit"):
        calibration_of(Settings(policy="joint"), str(tmp_path))
    if (SHIPPED / "calibration.json").exists():
        assert calibration_of(Settings(policy="per_request"), str(SHIPPED)).max_column == 8
