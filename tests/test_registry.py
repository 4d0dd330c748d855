"""The policy registry (issue 23 item 1): every method is built by one builder for the eval stage and the server, from
one config group (``conf/policy/``); both give the same schedule, and the server says which methods it cannot run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).parent))
from policy_fixtures import ALL_METHODS, CANDIDATES, RUN, build_tiny_run, tiny_overrides  # noqa: E402

from pipeline import PROJECT_ROOT  # noqa: E402
from pipeline.evaluation.inputs import load_eval_inputs, method_schedules  # noqa: E402
from pipeline.policy import registry, setup  # noqa: E402
from pipeline.policy.registry import METHODS  # noqa: E402
from pipeline.prompts import Prompt  # noqa: E402

CONF = str(PROJECT_ROOT / "conf")
# budget's batched step cost model, timed small (seconds) and cached in the run's data folder
COSTS = ["policy.budget.costs.rows=[1,4,8]", "policy.budget.costs.repeats=1", "policy.budget.costs.context=16",
         "policy.budget.costs.spot_check=false", "policy.verify_width.latency.spot_check=false"]
BUDGET = ["serve.max_batch=2", *COSTS]


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory) -> dict:
    return build_tiny_run(tmp_path_factory.getbasetemp() / "policy-run", tiny.target_dir("llama"), tiny.drafter_dir("llama", "trained"))


def eval_config(run: dict, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("evaluate", overrides=tiny_overrides(run) + [f"eval.methods={ALL_METHODS}", *overrides])


def serve_config(run: dict, policy: str, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("serve", overrides=[f"paths.data={run['data']}", f"run_name={RUN}", f"model.target={run['target']}",
                                           f"model.drafter={run['drafter']}", f"model.candidates={CANDIDATES}",
                                           f"serve.policy={policy}", "serve.warmup=false", "serve.max_batch=8",
                                           *overrides])


def trace(schedule, vocab: int) -> list:
    """What a schedule does on fixed inputs: its class, and for four random prefill logits rows the B it picks first,
    then the width it verifies (verify-width policies) and the B it asks for after a fixed series of step outcomes."""
    generator = torch.Generator().manual_seed(0)
    out: list = [type(schedule).__name__, getattr(schedule, "max_block_size", None)]
    for _ in range(4):
        b = int(schedule.first(torch.randn(vocab, generator=generator) * 3))
        steps = [b]
        for tau in (1, 4, 2, 8, 1, 1, 3):
            confidence = torch.rand(max(b - 1, 1), generator=generator, dtype=torch.float64)
            if hasattr(schedule, "choose_width") and b > 1:
                steps.append(("k", int(schedule.choose_width(confidence, 64))))
            b = int(schedule.next(min(tau, b), b))
            steps.append(b)
        out.append(steps)
    return out


def test_every_method_builds_the_same_schedule_through_eval_and_serve(run, tiny):
    from pipeline.serve import build_engine

    decoder = tiny.decoder("llama", "trained")
    cfg = eval_config(run)
    eval_factories = method_schedules(cfg, decoder, load_eval_inputs(cfg, ALL_METHODS, decoder))
    # every method the eval stage runs, with every input loaded; budget is the one batched-only method; the vLLM peers
    # run vLLM's server (tests/test_vllm.py)
    peers = sorted(m for m, d in METHODS.items() if registry.VLLM in d.needs)
    assert peers == ["vllm_ar", "vllm_dflash", "vllm_ngram", "vllm_suffix", "vllm_verify_width"]
    assert sorted(set(eval_factories) - set(peers)) == sorted(set(registry.EVALUABLE) - set(peers)) == sorted(ALL_METHODS)
    assert (set(peers) <= set(eval_factories)) == registry._vllm_installed()  # available where make vllm ran
    assert registry.BATCHED == ("budget",) and sorted(METHODS) == sorted(ALL_METHODS + ["budget"] + peers)
    vocab = decoder.lm_head.shape[0]
    served = []
    for name, method in METHODS.items():
        if name in peers:
            with pytest.raises(ValueError, match=f"serve.policy={name} cannot be served: vLLM serves itself"):
                build_engine(serve_config(run, name), decoder)
            continue
        if method.batched:  # served with continuous batching only; its texts are tested in test_serve.py
            engine = build_engine(serve_config(run, name, *BUDGET), decoder)
            try:
                assert engine.policy.name == name and engine.max_batch == 2
                assert engine.batch.policy is engine.policy.batch and engine.policy.batch.calibration is not None
                assert trace(engine.policy(), vocab) == trace(eval_factories["fixed"](), vocab)  # drafts at the fixed B
            finally:
                engine.close()
            with pytest.raises(ValueError, match="eval.methods \\['budget'\\] cannot be evaluated here.*bench_batch"):
                registry.build(name, registry.Context(decoder))
            served.append(name)
            continue
        made = eval_factories[name]
        if method.servable is not None:
            with pytest.raises(ValueError, match=f"serve.policy={name} cannot"):
                build_engine(serve_config(run, name), decoder)
            continue
        engine = build_engine(serve_config(run, name), decoder)
        try:
            assert engine.policy.name == name
            assert trace(engine.policy(), vocab) == trace(made(), vocab), name
        finally:
            engine.close()
        served.append(name)
    assert served == list(registry.SERVABLE) and "oracle" not in served and "hf_generate" not in served
    oracle = eval_factories["oracle"]  # the eval-only bound: bound to each request
    assert oracle.per_request and oracle.bind(Prompt("code-0", ["x"], "code"))().block_size in CANDIDATES


def test_one_option_reaches_both_stages(run, tiny):
    """``policy.<method>.*`` is read by both: the same override changes the eval's and the server's schedule alike."""
    from pipeline.serve import build_engine

    decoder = tiny.decoder("llama", "trained")
    cfg = eval_config(run, "eval.methods=[ar,ema]", "policy.ema.start=12", "policy.ema.alpha=0.9")
    ema_eval = method_schedules(cfg, decoder)["ema"]()
    engine = build_engine(serve_config(run, "ema", "policy.ema.start=12", "policy.ema.alpha=0.9"), decoder)
    try:
        ema_serve = engine.policy()
    finally:
        engine.close()
    assert ema_eval.first(torch.zeros(4)) == ema_serve.first(torch.zeros(4)) == 12
    assert trace(ema_eval, decoder.lm_head.shape[0]) == trace(ema_serve, decoder.lm_head.shape[0])
    assert trace(ema_eval, 4) != trace(method_schedules(eval_config(run), decoder)["ema"](), 4)  # the option mattered


def test_serving_a_run_without_a_predictor_names_the_run_and_make_run(run, tiny):
    """Issue 23 item 7: after ``make all EXPERIMENT=quick`` the server (run_name main) pointed at the main run; now the
    message names the run it looked in, the runs that have a predictor, and ``make serve RUN=...``."""
    from pipeline.serve import build_engine

    with pytest.raises(FileNotFoundError) as err:
        build_engine(serve_config(run, "blockpilot", "run_name=main"), tiny.decoder("llama", "trained"))
    message = str(err.value)
    assert "run_name=main" in message and f"make serve RUN={RUN} ARGS='serve.policy=blockpilot'" in message


def test_default_block_size_and_the_vocabulary_check_are_written_once(tiny):
    from types import SimpleNamespace

    decoder = tiny.decoder("llama", "trained")
    assert registry.default_block_size(decoder) == decoder.drafter.block_size == 8
    assert registry.default_block_size(decoder, 3) == 3
    assert registry.default_block_size(SimpleNamespace(drafter=None)) == 1
    other = SimpleNamespace(featurizer=SimpleNamespace(spec=SimpleNamespace(vocab_size=decoder.lm_head.shape[0] + 1)),
                            candidates=[2, 4])
    with pytest.raises(ValueError, match="vocabulary of"):
        setup.check_predictor(other, decoder, "somewhere")
    with pytest.raises(ValueError, match="unknown serve.policy 'beam'"):
        registry.build("beam", registry.Context(decoder, where="serve"))
    with pytest.raises(ValueError, match="needs labels"):
        registry.build("oracle", registry.Context(decoder))


def bench_config(run: dict, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("bench_batch", overrides=[f"paths.data={run['data']}", f"run_name={RUN}",
                                                 f"model.target={run['target']}", f"model.drafter={run['drafter']}",
                                                 f"model.candidates={CANDIDATES}", "bench.concurrency=[2]", *overrides])


def graph(policy) -> dict:
    """What a batch policy is made of: its class and, for a joint one, its calibration, cost model and options."""
    out = {"class": type(policy).__name__}
    if hasattr(policy, "costs"):
        out.update(calibration=policy.calibration.to_dict(), costs=policy.costs.to_dict(), skip=policy.skip_drafts,
                   max_skip=policy.max_skip, gate=policy.gate, margin=policy.margin)
    return out


def test_every_batched_method_is_the_same_object_graph_in_the_server_and_in_bench_batch(run, tiny):
    """The one method table (issue 33 item 2): ``bench_batch`` measures what the server runs. Each method it runs is
    built both ways from the same settings, and gives the same schedule (the same choices on the same inputs) under
    the same kind of batch policy, with the same calibration, cost models and options."""
    from pipeline.evaluation.batched import sources
    from pipeline.serve import build_engine

    decoder = tiny.decoder("llama", "trained")
    vocab = decoder.lm_head.shape[0]
    bench_cfg = bench_config(run, *COSTS)
    for name in ("ar", "fixed", "verify_width", "budget"):
        bench_cfg.bench.methods = [name]
        inputs = setup.load_inputs(bench_cfg, decoder, [name], sources(bench_cfg))
        factory = setup.build_methods(bench_cfg, decoder, inputs, [name], sources(bench_cfg))[name]
        engine = build_engine(serve_config(run, name, *BUDGET), decoder)
        try:
            assert trace(engine.policy(), vocab) == trace(factory(), vocab), name
            assert graph(engine.policy.batch) == graph(factory.batch), name
            if name == "verify_width":  # the batch-1 cost model its schedules read: the same measurement
                assert engine.policy().cost_model.to_dict() == factory().cost_model.to_dict()
        finally:
            engine.close()


def test_mixed_sizes_its_trees_on_the_batched_cost_model_where_many_requests_share_a_step(run, tiny):
    """``mixed`` is load-sized: bench_batch (and the server) load the batched step cost model for it, and its schedules
    price a node at what its row adds to a step of ``load`` requests; the eval stage (one request at a time) does not."""
    from pipeline.evaluation.batched import sources

    decoder = tiny.decoder("llama", "trained")
    bench_cfg = bench_config(run, *COSTS, "bench.methods=[mixed]")
    inputs = setup.load_inputs(bench_cfg, decoder, ["mixed"], sources(bench_cfg))
    assert inputs.batch_costs is not None
    schedule = setup.build_methods(bench_cfg, decoder, inputs, ["mixed"], sources(bench_cfg))["mixed"]()
    assert schedule.batch_costs is inputs.batch_costs
    one = dataclasses.replace(sources(bench_cfg), max_requests=1)
    assert setup.load_inputs(bench_cfg, decoder, ["mixed"], one).batch_costs is None


def test_which_methods_run_the_drafter_and_what_mixed_reads_without_one(tiny):
    """``ar`` never runs the drafter and ``mixed`` only with ``drafter`` among its sources (a server loads none
    otherwise); ``mixed`` reads no calibration where it drafts from the free sources alone, every other drafting method
    does, and with no drafter loaded a method that needs one is refused naming ``model.drafter``."""
    from pipeline.policy.setup import load_verify_width

    assert not registry.uses_drafter("ar", {}) and registry.uses_drafter("verify_width", {})
    assert registry.uses_drafter("mixed", {})  # the module's default sources include the drafter
    assert not registry.uses_drafter("mixed", {"mixed": {"sources": ["ngram", "cache"]}})
    free, drafted = {"mixed": {"sources": ["ngram"]}}, {"mixed": {"sources": ["drafter", "ngram"]}}
    mixed = registry.METHODS["mixed"]
    with_drafter, without = tiny.decoder("llama", "random"), tiny.decoder("llama", None)
    assert registry.needs_of(mixed, free, with_drafter) == {registry.COSTS}
    assert registry.needs_of(mixed, drafted, with_drafter) == {registry.CALIBRATION, registry.COSTS}
    assert registry.needs_of(mixed, drafted, without) == {registry.COSTS}
    assert registry.needs_of(registry.METHODS["tree"], free, without) == {registry.CALIBRATION, registry.COSTS}
    with pytest.raises(ValueError, match="need a drafter"):
        load_verify_width(registry.PolicyInputs(), without, {}, None, None, [1])
    inputs = registry.PolicyInputs()
    load_verify_width(inputs, without, {}, None, None, [1], calibrate=False)  # no cfg: no latency either
    assert inputs.calibration is None and inputs.latency is None
    assert registry.missing_inputs(mixed, registry.PolicyInputs(latency=object()), free, without) == []
    costs_only = registry.PolicyInputs(latency=object())
    assert registry.missing_inputs(mixed, costs_only, drafted, with_drafter) == ["calibration"]
