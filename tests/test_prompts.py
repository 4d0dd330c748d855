"""Prompt sets: JSONL files, HumanEval from its package, hub specs, limits/seeds, chat templates."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

import pipeline.prompts as prompts_module
from conftest import require, shared_data_dir
from pipeline.prompts import (HUMANEVAL_INSTRUCTION, Prompt, chat_input_ids, load_prompt_set, load_prompt_sets, prompt_id_of,
                              request_id)
from tiny_models import make_tiny_tokenizer


def write_jsonl(path, rows) -> str:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def five_prompts(tmp_path) -> str:
    rows = [{"id": f"p{i}", "turns": [f"question {i}"], "source": f"test@0:{i}"} for i in range(4)]
    rows.insert(2, "   ")  # blank lines are skipped
    rows.append({"id": 7, "turns": ["first turn", "second turn"]})
    return write_jsonl(tmp_path / "mine.jsonl", rows)


def test_jsonl_loading(five_prompts):
    prompts = load_prompt_set(five_prompts)
    assert [p.id for p in prompts] == ["p0", "p1", "p2", "p3", "7"]
    assert prompts[0].turns == ["question 0"] and prompts[0].source_set == "mine"
    assert prompts[0].meta == {"source": "test@0:0"}
    assert prompts[-1].turns == ["first turn", "second turn"] and prompts[-1].meta == {"source": ""}
    assert {p.source_set for p in load_prompt_set(five_prompts, name="custom")} == {"custom"}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"turns": ["no id"]}, r"mine.jsonl:2: each row needs 'id' and 'turns'"),
        ({"id": "x"}, r"mine.jsonl:2: each row needs 'id' and 'turns'"),
        ({"id": "x", "turns": "not a list"}, r"mine.jsonl:2: 'turns' must be a list of strings"),
        ({"id": "x", "turns": ["ok", "  "]}, r"prompt 'x' has an empty turn"),
        ({"id": "x", "turns": []}, r"prompt 'x' has an empty turn"),
    ],
)
def test_jsonl_errors(tmp_path, row, message):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"id": "fine", "turns": ["hello"]}, row])
    with pytest.raises(ValueError, match=message):
        load_prompt_set(path)


def test_missing_file_names_the_shared_data(tmp_path):
    with pytest.raises(FileNotFoundError, match="shared/data"):
        load_prompt_set(str(tmp_path / "nope.jsonl"))


def test_prompt_rejects_non_text_turns():
    with pytest.raises(ValueError, match="empty turn"):
        Prompt("x", ["fine", 3], "test")


def test_humaneval_from_the_package():
    prompts = load_prompt_set("humaneval")
    assert len(prompts) == 164
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    first = prompts[0]
    assert first.source_set == "humaneval" and first.meta["entry_point"] == "has_close_elements"
    assert len(first.turns) == 1
    assert first.turns[0].startswith(HUMANEVAL_INSTRUCTION.split("{prompt}")[0])
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first.turns[0]


def test_limit_and_seed():
    first_five = load_prompt_set("humaneval", limit=5)
    assert [p.id for p in first_five] == [f"HumanEval/{i}" for i in range(5)]
    a = [p.id for p in load_prompt_set("humaneval", limit=10, seed=1)]
    b = [p.id for p in load_prompt_set("humaneval", limit=10, seed=1)]
    c = [p.id for p in load_prompt_set("humaneval", limit=10, seed=2)]
    assert a == b and a != c and len(set(a)) == 10
    assert a != [f"HumanEval/{i}" for i in range(10)]
    shuffled = [p.id for p in load_prompt_set("humaneval", seed=1)]
    assert shuffled[:10] == a and sorted(shuffled) == sorted(f"HumanEval/{i}" for i in range(164))


def test_load_prompt_sets_with_per_set_limits(five_prompts):
    sets = [{"name": "mine", "source": five_prompts, "limit": 2}, {"name": "he", "source": "humaneval"}]
    prompts = load_prompt_sets(sets, limit_per_set=3)
    assert [p.source_set for p in prompts] == ["mine", "mine", "he", "he", "he"]
    assert [p.id for p in prompts] == ["p0", "p1", "HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_a_skipped_sets_share_goes_to_data_skipped_to(five_prompts, tmp_path, caplog):
    """``data.skipped_to`` (the demo: HumanEval): a set that takes the share of prompts of every set skipped
    (``missing=skip``), so a clone without ../shared/ runs about as many requests as one with every set (issue 41)."""
    gone = [{"name": "gsm8k", "source": str(tmp_path / "gsm8k.jsonl")},
            {"name": "mbpp", "source": str(tmp_path / "mbpp.jsonl"), "limit": 2}]
    sets = [{"name": "he", "source": "humaneval"}, {"name": "mine", "source": five_prompts}, *gone]
    alone = load_prompt_sets(sets, 1, seed=0, missing="skip")
    assert [p.source_set for p in alone] == ["he", "mine"]  # without it: one prompt each from the sets there are
    with caplog.at_level("WARNING", logger="pipeline.prompts"):
        shared = load_prompt_sets(sets, 1, seed=0, missing="skip", skipped_to="he")
    # he takes gsm8k's 1 and mbpp's 2 (its own limit): 1 + 3 prompts, the same first one (same seed), then mine's
    assert [p.source_set for p in shared] == ["he"] * 4 + ["mine"] and shared[0].id == alone[0].id
    assert [p.id for p in shared[:4]] == [p.id for p in load_prompt_set("humaneval", limit=4, seed=0)]
    assert "prompt set he takes the share of the 2 skipped set(s) (data.skipped_to): 4 prompts instead of 1" in caplog.text
    assert [p.source_set for p in load_prompt_sets(sets, 1, missing="skip", skipped_to="mine")] == ["he"] + ["mine"] * 4
    # nothing skipped, or no limit (every prompt is read anyway): no change
    present = sets[:2]
    assert load_prompt_sets(present, 1, missing="skip", skipped_to="he") == load_prompt_sets(present, 1)
    assert len(load_prompt_sets(sets, None, missing="skip", skipped_to="he")) == 164 + 5
    # a skipped set without a limit: the share is all of it
    unlimited = [{"name": "he", "source": "humaneval", "limit": 1}, {"name": "gsm8k", "source": str(tmp_path / "x.jsonl")}]
    assert len(load_prompt_sets(unlimited, None, missing="skip", skipped_to="he")) == 164
    # a name that is none of the sets (the demo's HumanEval under data=gsm8k) gives no set a share
    assert load_prompt_sets(sets, 1, missing="skip", skipped_to="humaneval") == load_prompt_sets(sets, 1, missing="skip")


def test_the_demo_gives_humaneval_the_skipped_sets_share(compose_config):
    from pipeline.decoding.checks import check_data

    cfg = compose_config("evaluate", ["experiment=demo"])
    assert (cfg.data.limit, cfg.data.missing, cfg.data.skipped_to) == (1, "skip", "humaneval")
    check_data(cfg.data)
    assert compose_config("evaluate", []).data.skipped_to is None  # other runs: a missing set stops them anyway
    check_data(compose_config("evaluate", ["experiment=demo", "data=gsm8k"]).data)  # HumanEval not among the sets: no share
    with pytest.raises(ValueError, match=r"data.skipped_to=3: the name of the set"):
        check_data(compose_config("evaluate", ["experiment=demo", "data.skipped_to=3"]).data)


def test_hub_spec_is_parsed(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(dataset_id, split):
        calls.append((dataset_id, split))
        return [{"question": "What is 2+2?"}, {"question": "Name a prime."}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    prompts = load_prompt_set("hub:org/quiz:validation:question")
    assert calls == [("org/quiz", "validation")]
    assert [(p.id, p.turns, p.source_set) for p in prompts] == [
        ("quiz-0", ["What is 2+2?"], "quiz"), ("quiz-1", ["Name a prime."], "quiz")]


@pytest.mark.parametrize("name, rows, turns", [("gsm8k", 1319, 1), ("math500", 500, 1), ("mbpp", 427, 1), ("mt_bench", 80, 2)])
def test_shared_prompt_sets(name, rows, turns):
    path = shared_data_dir() / f"{name}.jsonl"
    require(path.exists(), f"{path} not found (set BLOCKPILOT_SHARED_DATA)")
    prompts = load_prompt_set(str(path))
    assert len(prompts) == rows and len({p.id for p in prompts}) == rows
    assert all(len(p.turns) == turns for p in prompts)
    assert all(p.source_set == name for p in prompts)


def test_chat_template_single_and_multi_turn():
    tokenizer = make_tiny_tokenizer()
    ids = chat_input_ids(tokenizer, ["Hi there"])
    assert ids.ndim == 2 and ids.shape[0] == 1
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = chat_input_ids(tokenizer, ["Hi there", "And then?"], replies=["Hello!"])
    assert tokenizer.decode(ids[0]) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    )
    # only the turns up to the next reply are used
    assert chat_input_ids(tokenizer, ["Hi there", "And then?"]).tolist() == chat_input_ids(tokenizer, ["Hi there"]).tolist()


def test_no_chat_template_uses_the_raw_text():
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = None
    ids = chat_input_ids(tokenizer, ["def add(a, b):", "more"], replies=["return a + b"])
    assert tokenizer.decode(ids[0]) == "def add(a, b):\n\nreturn a + b\n\nmore"


def test_request_ids_name_each_turn():
    assert request_id("HumanEval/3", 0) == "HumanEval/3" and request_id("mt_bench-81", 1) == "mt_bench-81#turn2"
    for pid in ("HumanEval/3", "mt_bench-81", "a#turnx", "a#turn"):
        assert [prompt_id_of(request_id(pid, t)) for t in range(3)] == [pid] * 3
    with pytest.raises(ValueError, match="turn"):
        request_id("p", -1)


def test_offset_gives_prompts_a_limited_run_never_saw(five_prompts):
    first = load_prompt_set(five_prompts, limit=3, seed=1)
    rest = load_prompt_set(five_prompts, limit=3, seed=1, offset=3)
    every = load_prompt_set(five_prompts, seed=1)
    assert [p.id for p in first + rest] == [p.id for p in every] and len(rest) == 2
    assert [p.id for p in load_prompt_sets([{"source": five_prompts}], 1, 1, offset=4)] == [every[4].id]
    with pytest.raises(ValueError, match="data.offset"):
        load_prompt_set(five_prompts, offset=-1)


@pytest.mark.parametrize("bad_line", ['{"id": "p9", "turns": ["cut he', '[1, 2', "not json at all"])
def test_a_truncated_jsonl_line_names_the_file_and_line(tmp_path, bad_line):
    """Issue 15 item 6: a cut line used to raise a bare JSONDecodeError with neither file nor line number."""
    path = write_jsonl(tmp_path / "cut.jsonl", [{"id": "p0", "turns": ["fine"]}, "", bad_line])
    with pytest.raises(ValueError, match=r"cut.jsonl:3: not valid JSON .*fix or remove that line"):
        load_prompt_set(path)


# -- model.chat_template_kwargs (issue 24 item 2) -------------------------------------------------------------------
def test_chat_template_kwargs_are_the_default_and_a_request_still_wins():
    from pipeline.prompts import chat_template_kwargs, messages_input_ids, set_chat_template_kwargs
    from tiny_models import QWEN3_TEMPLATE

    tok = make_tiny_tokenizer(chat_template=QWEN3_TEMPLATE)
    text = lambda ids: tok.decode(ids[0])  # noqa: E731
    thinking = text(chat_input_ids(tok, ["hi"]))  # the template's default: thinking on, no empty think block
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking
    set_chat_template_kwargs(tok, {"enable_thinking": False})  # model.chat_template_kwargs of the qwen3_4b preset
    assert chat_template_kwargs(tok) == {"enable_thinking": False}
    off = text(chat_input_ids(tok, ["hi"]))
    assert off == thinking + "<think>\n\n</think>\n\n"
    assert text(chat_input_ids(tok, ["hi", "again"], ["yes"])).endswith("again<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    messages = [{"role": "user", "content": "hi"}]
    assert text(messages_input_ids(tok, messages)) == off
    assert text(messages_input_ids(tok, messages, enable_thinking=True)) == thinking  # a request's own kwargs win
    set_chat_template_kwargs(tok, {})
    assert text(chat_input_ids(tok, ["hi"])) == thinking


def test_chat_template_kwargs_config_and_label_checks(compose_config):
    from pipeline.config_checks import validate_config
    from pipeline.prompts import check_label_template_kwargs, template_kwargs_of

    qwen = compose_config("label", ["model=qwen3_4b", "model.device=cpu"]).model
    assert template_kwargs_of(qwen) == {"enable_thinking": False}
    assert template_kwargs_of(compose_config("label").model) == {}  # smollm2: the template's own default
    with pytest.raises(ValueError, match=r"model.chat_template_kwargs=False: give a mapping"):
        validate_config(compose_config("label", ["model.chat_template_kwargs=false"]), "label")
    check_label_template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}, qwen, "labels/x")
    check_label_template_kwargs({"target": "t"}, compose_config("label").model, "labels/x")  # made before: none
    check_label_template_kwargs({}, qwen, "labels/x")  # no meta.json: nothing to compare
    with pytest.raises(ValueError, match=r"labels in labels/x were made with model.chat_template_kwargs=\{\} but this "
                                         r"run has \{'enable_thinking': False\}.*Relabel.*'model.chat_template_kwargs=null'"):
        check_label_template_kwargs({"target": "t"}, qwen, "labels/x")
    with pytest.raises(ValueError, match=r"'model.chat_template_kwargs=\{enable_thinking: false\}'"):
        check_label_template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}, compose_config("label").model, "l")


def _fake_hub(monkeypatch, tables: dict):
    """``datasets.load_dataset`` serving ``tables[(dataset_id, config, split)]`` (rows) and recording the calls."""
    import datasets

    calls = []

    def load_dataset(dataset_id, name=None, split=None):
        calls.append((dataset_id, name, split))
        return tables[(dataset_id, name, split)]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(prompts_module, "_HUB_CACHE", {})
    return calls



def test_hub_copies_give_the_shared_files_ids_and_turns(monkeypatch):
    """Each ``HUB_SETS`` recipe builds the prompts of its JSONL file (ids, turns, order) from the hub's rows."""
    tables = {
        ("openai/gsm8k", "main", "test"): [{"question": "Q0", "answer": "A"}, {"question": "Q1", "answer": "B"}],
        ("HuggingFaceH4/MATH-500", None, "test"): [{"problem": "P", "unique_id": "test/precalculus/807.json"},
                                                   {"problem": "R", "unique_id": "test/intermediate_algebra/1994.json"}],
        ("lighteval/mt-bench", None, "train"): [{"question_id": 82, "category": "writing", "turns": ["c", "d"]},
                                                {"question_id": 81, "category": "writing", "turns": ["a", "b"]}],
        **{("google-research-datasets/mbpp", "sanitized", split): rows for split, rows in {
            "prompt": [{"task_id": 3, "prompt": "Write f. ", "test_list": ["assert f(1) == 2", "assert f(2) == 3"]}],
            "train": [{"task_id": 600, "prompt": "Write g.", "test_list": ["assert g() is None"]}],
            "validation": [],
            "test": [{"task_id": 2, "prompt": "Write h.", "test_list": ["assert h(0) == 0"]}]}.items()},
    }
    calls = _fake_hub(monkeypatch, tables)
    got = {d: prompts_module.hub_set_prompts(d) for d in prompts_module.HUB_SETS}
    assert [(p.id, p.turns) for p in got["openai/gsm8k"]] == [("gsm8k-test-0000", ["Q0"]), ("gsm8k-test-0001", ["Q1"])]
    assert [p.id for p in got["HuggingFaceH4/MATH-500"]] == ["math500-precalculus-807", "math500-intermediate_algebra-1994"]
    assert [(p.id, p.turns) for p in got["lighteval/mt-bench"]] == [("mt_bench-81-writing", ["a", "b"]),
                                                                   ("mt_bench-82-writing", ["c", "d"])]
    assert [(p.id, p.turns) for p in got["google-research-datasets/mbpp"]] == [
        ("mbpp-2", ["Write h.\nYour code should pass this test:\nassert h(0) == 0"]),
        ("mbpp-3", ["Write f.\nYour code should pass this test:\nassert f(1) == 2"]),
        ("mbpp-600", ["Write g.\nYour code should pass this test:\nassert g() is None"])]
    assert got["openai/gsm8k"][0].meta == {"source": "hub:openai/gsm8k"}
    prompts_module.hub_set_prompts("openai/gsm8k")[0].turns.append("changed")  # callers get copies, loaded once
    assert got["openai/gsm8k"][0].turns == ["Q0"] and prompts_module.hub_set_prompts("openai/gsm8k")[0].turns == ["Q0"]
    assert len(calls) == 1 + 1 + 1 + 4


@pytest.mark.parametrize("name", ["gsm8k", "mbpp", "mt_bench"])
def test_the_hub_recipes_reproduce_the_shared_files(name, monkeypatch):
    """Rows shaped like the hub's, made from the shared file itself (shuffled across splits), give back the file."""
    path = shared_data_dir() / f"{name}.jsonl"
    require(path.exists(), f"{path} not found (set BLOCKPILOT_SHARED_DATA)")
    shared = load_prompt_set(str(path))
    if name == "gsm8k":
        key, rows = ("openai/gsm8k", "main", "test"), [{"question": p.turns[0]} for p in shared]
    elif name == "mt_bench":
        key = ("lighteval/mt-bench", None, "train")
        rows = [{"question_id": int(p.id.split("-")[1]), "category": p.id.split("-")[2], "turns": p.turns} for p in shared][::-1]
    else:
        key = ("google-research-datasets/mbpp", "sanitized", "test")
        rows = [{"task_id": int(p.id.split("-")[1]), "prompt": p.turns[0].split(prompts_module.MBPP_TEST_INTRO)[0],
                 "test_list": [p.turns[0].split(prompts_module.MBPP_TEST_INTRO)[1]]} for p in shared][::-1]
    tables = {key: rows}
    if name == "mbpp":
        tables.update({(*key[:2], s): [] for s in ("prompt", "train", "validation")})
    _fake_hub(monkeypatch, tables)
    hub = load_prompt_set(str(path.with_name("missing.jsonl")), name=name, hub=key[0])
    assert [(p.id, p.turns, p.source_set) for p in hub] == [(p.id, p.turns, p.source_set) for p in shared]


def test_a_missing_file_with_an_unreachable_hub_names_both_fixes(tmp_path, monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(prompts_module, "_HUB_CACHE", {})
    sets = [{"name": "gsm8k", "source": str(tmp_path / "gsm8k.jsonl"), "hub": "openai/gsm8k"}]
    with pytest.raises(FileNotFoundError) as err:
        load_prompt_sets(sets)
    message = str(err.value)
    assert message.startswith(f"prompt set gsm8k: {tmp_path}/gsm8k.jsonl not found and its hub copy could not be loaded")
    assert "BLOCKPILOT_SHARED_DATA=" in message and "Hugging Face hub" in message and "data.missing=skip" in message
    with pytest.raises(FileNotFoundError, match="none of the configured prompt sets could be loaded"):
        load_prompt_sets(sets, missing="skip")
    with pytest.raises(ValueError, match="data.missing='maybe'"):
        load_prompt_sets(sets, missing="maybe")


FRESH_CLONE = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from hydra import compose, initialize_config_dir
from pipeline.evaluation.inputs import check_prompts, select_prompts
from pipeline.evaluation.runs import EvalInputs
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose("evaluate", ["experiment=demo", "paths.shared_data=" + sys.argv[2]])
print(json.dumps({"checked": check_prompts(cfg), "ids": [p.id for p in select_prompts(cfg, None, EvalInputs())]}))
"""


def test_a_fresh_clone_without_shared_data_or_hub_runs_the_demo_sets_it_has(tmp_path):
    """``make demo`` on a clone with no ../shared/data and no hub: HumanEval (from its package) still loads, and each
    missing set is reported once, by name, with how to provide it."""
    import os
    import subprocess
    import sys

    from conftest import CONF_DIR
    from pipeline import PROJECT_ROOT

    empty = tmp_path / "shared"
    empty.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("BLOCKPILOT_SHARED_DATA", None)
    result = subprocess.run([sys.executable, "-c", FRESH_CLONE, str(CONF_DIR), str(empty)], cwd=PROJECT_ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # data.limit=1 per set, and HumanEval takes the four skipped sets' share (data.skipped_to): 5 requests
    assert out["checked"] == 164 and len(set(out["ids"])) == 5 and all(i.startswith("HumanEval/") for i in out["ids"])
    assert "WARNING prompt set humaneval takes the share of the 4 skipped set(s)" in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING skipping a prompt set")]
    for name in ("mbpp", "gsm8k", "math500", "mt_bench"):
        mine = [w for w in warnings if f"prompt set {name}: {empty}/{name}.jsonl not found" in w]
        assert len(mine) == 1, (name, result.stderr)  # once, though the prompts were read twice
        assert "BLOCKPILOT_SHARED_DATA=" in mine[0] and "Hugging Face hub" in mine[0]
    assert len(warnings) == 4


def test_spec_bench_categories_are_sets_of_their_own(tmp_path, compose_config):
    """``data=spec_bench``: each category of Spec-Bench's ids (``spec_bench-<qid>-<category>``) is its own set in the
    reports, limit and offset count per category, ``categories`` keeps some."""
    from pipeline.prompts import category_of, load_prompt_sets

    rows = [{"id": f"spec_bench-{i}-{cat}", "turns": [f"question {i} of {cat}"], "source": "test"}
            for i, cat in enumerate(["qa"] * 5 + ["summarization"] * 4 + ["math_reasoning"] * 3)]
    path = tmp_path / "spec_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert category_of("spec_bench-81-writing") == "writing" and category_of("spec_bench-401-math_reasoning") == "math_reasoning"
    spec = {"name": "spec_bench", "source": str(path), "by_category": True}
    every = load_prompt_sets([spec], 2, seed=0)
    assert [p.source_set for p in every] == ["spec_bench-math_reasoning"] * 2 + ["spec_bench-qa"] * 2 + ["spec_bench-summarization"] * 2
    assert all(p.source_set == f"spec_bench-{category_of(p.id)}" for p in every)
    some = load_prompt_sets([{**spec, "categories": ["summarization", "qa"]}], None, seed=0)
    assert [p.source_set for p in some] == ["spec_bench-summarization"] * 4 + ["spec_bench-qa"] * 5
    later = load_prompt_sets([{**spec, "categories": ["qa"]}], 2, seed=0, offset=2)
    assert not {p.id for p in later} & {p.id for p in every}  # offset per category: prompts the first run never saw
    with pytest.raises(ValueError, match=r"no categories \['rag'\]"):
        load_prompt_sets([{**spec, "categories": ["rag"]}])
    cfg = compose_config("evaluate", ["data=spec_bench"])
    assert cfg.data.sets[0].by_category and cfg.data.sets[0].source.endswith("spec_bench.jsonl")
    shared = Path(cfg.data.sets[0].source)
    if shared.exists():  # the real file (../shared/data): 480 prompts, 13 categories of 80 or 10
        counts = collections.Counter(p.source_set for p in load_prompt_sets(cfg.data.sets))
        assert len(counts) == 13 and sum(counts.values()) == 480 and counts["spec_bench-qa"] == 80
