"""``pipeline.cli``: a stage's user errors print as one line (``error: <message>``, exit 2), a misspelt key gets the
closest existing key, and real bugs keep their traceback (issue 33 item 10)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline import PROJECT_ROOT
from pipeline.cli import EXIT_USER_ERROR, closest_key, config_keys, is_user_error, stage


def run_stage(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_misspelt_key_names_the_closest_one():
    """Hydra alone would advise adding the key with ``+``."""
    result = run_stage("pipeline.evaluate", "eval.metods=[ar]")
    assert result.returncode == EXIT_USER_ERROR
    assert result.stderr == "error: unknown key eval.metods; did you mean eval.methods?\n"


def test_a_bad_value_prints_its_message_alone_before_any_model_loads():
    result = run_stage("pipeline.evaluate", "decode.temperature=nan", "model.target=/nonexistent/target")
    assert result.returncode == EXIT_USER_ERROR
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: decode.temperature=nan: the temperature must be a finite number >= 0 (0 = greedy), e.g. "
                     "decode.temperature=0.7"], result.stderr


def test_closest_key_over_the_composed_config(compose_config):
    keys = config_keys(compose_config("evaluate", ["experiment=demo"]))
    assert {"eval", "eval.methods", "decode.temperature", "paths.shared_data"} <= set(keys)
    assert closest_key("eval.metods", keys) == "eval.methods"
    assert closest_key("decode.temprature", keys) == "decode.temperature"
    assert closest_key("evl.methods", keys) == "eval.methods"
    assert closest_key("zzzz.qqqq", keys) is None


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001
        return err
    raise AssertionError("nothing raised")


def test_user_errors_are_the_projects_own_raises():
    from pipeline.decoding.checks import check_temperature
    from pipeline.policy.checks import check_policy_options
    from pipeline.prompts import jsonl_prompts

    assert is_user_error(_raised(lambda: check_temperature(-1.0)))
    assert is_user_error(_raised(lambda: jsonl_prompts("/nonexistent/set.jsonl")))
    # int("x") failing inside the project's code, and numpy's own error: bugs, shown with their traceback
    assert not is_user_error(_raised(lambda: check_policy_options(OmegaConf.create({"policy": {"verify_width": {"block_size": "x"}}}))))
    assert not is_user_error(_raised(lambda: np.zeros(2).reshape(3)))
    assert not is_user_error(_raised(lambda: {}["key"]))


@pytest.fixture
def argv(monkeypatch, tmp_path):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def set_args(*args):
        monkeypatch.setattr(sys, "argv", ["stage", f"paths.data={tmp_path}", "logger.enabled=false", *args])

    return set_args


def test_the_stage_decorator_one_line_for_user_errors_traceback_for_bugs(argv, capsys):
    from pipeline.decoding.checks import check_temperature

    calls = []

    @stage("evaluate")
    def user_error(cfg):
        calls.append(cfg.decode.temperature)
        check_temperature(cfg.decode.temperature)

    @stage("evaluate")
    def bug(cfg):
        np.zeros(2).reshape(3)

    argv("decode.temperature=-1")
    with pytest.raises(SystemExit) as exit_info:
        user_error()
    assert exit_info.value.code == EXIT_USER_ERROR and calls == [-1]
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: decode.temperature=-1: the temperature must be a finite number >= 0 (0 = greedy), e.g. decode.temperature=0.7"]
    assert "HYDRA_FULL_ERROR" not in os.environ  # set for the call only
    argv()
    with pytest.raises(ValueError, match="cannot reshape"):  # propagates: Python prints the traceback
        bug()
    argv("decode.temperature=-1")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # the user asks for every traceback
    try:
        with pytest.raises(ValueError, match="decode.temperature=-1"):
            user_error()
    finally:
        del os.environ["HYDRA_FULL_ERROR"]
    with pytest.raises(ValueError, match="decode.temperature=-2"):  # called with a config: runs as written
        user_error(OmegaConf.create({"decode": {"temperature": -2}}))
