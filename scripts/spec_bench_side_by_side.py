"""Our server against vLLM's on Spec-Bench, all through ``vllm bench serve`` (``scripts/vllm_bench_serve.py``), one
command: for each server configuration it starts the server, runs the tool at each concurrency over the same
category-stratified sample of Spec-Bench (greedy, the same prompt order everywhere), scrapes ``/metrics`` before and
after each run, stops the server, and prints Markdown tables: per configuration and concurrency the output tokens/s,
TTFT, TPOT and acceptance length (from the server's ``vllm:spec_decode_*`` counters, as the tool reads them), the
server's own TTFT beside the tool's, and how many texts equal our ``ar``'s; then per category at concurrency 1, the
mean TTFT and TPOT, and with ``--by-category`` each category run alone at concurrency 1 (its tokens/s and acceptance
length: the counters are global, so per-category acceptance needs runs of its own). Needs ``make vllm`` and ``make bench-tools``; run it with nothing else on the machine.

    .venv/bin/python scripts/spec_bench_side_by_side.py --per-category 2 --output-len 64 --concurrency 1 4 16 --by-category

Configurations (``--configs``): ``ours:<serve.policy>`` (``make serve``; ar, verify_width, budget, ...) and
``vllm:ar``, ``vllm:dflash`` (vLLM's own DFlash, every draft verified), ``vllm:<plugin policy>`` (DFlash with our
plugin: verify_width, budget). Writes everything under ``--out`` (the sample, each run's result JSON, summary.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
PY = ROOT / ".venv" / "bin" / "python"

from pipeline.serving.metrics import scrape  # noqa: E402


def write_sample(source: Path, per_category: int, out: Path) -> tuple[Path, list[str]]:
    """The first ``per_category`` prompts of every category (file order), in vLLM's Spec-Bench layout; their categories."""
    from pipeline.prompts import category_of, write_spec_bench_for

    rows, seen = [], {}
    for line in source.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        cat = category_of(row["id"])
        if seen.get(cat, 0) < per_category:
            seen[cat] = seen.get(cat, 0) + 1
            rows.append(row)
    rows.sort(key=lambda r: category_of(r["id"]))  # stable: file order within a category
    ours = out / "spec_bench_sample_ours.jsonl"
    ours.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return write_spec_bench_for(ours, out / "spec_bench_sample_vllm.jsonl"), [category_of(r["id"]) for r in rows]


def start(config: str, port: int, log: Path, vllm_args: list[str] = ()) -> subprocess.Popen:
    kind, policy = config.split(":", 1)
    if kind == "ours":
        cmd = [str(PY), "-m", "pipeline.serve", f"serve.policy={policy}", f"serve.port={port}"]
    elif kind == "vllm":
        method, plugin = ("ar", "off") if policy == "ar" else ("dflash", "off") if policy == "dflash" else ("dflash", policy)
        cmd = [str(PY), "-m", "pipeline.serve_vllm", f"vllm.method={method}", f"vllm.policy={plugin}", f"vllm.port={port}",
               *vllm_args]
    else:
        raise SystemExit(f"error: configuration {config!r}: use ours:<serve.policy> or vllm:<ar|dflash|plugin policy>")
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while time.monotonic() - t0 < 900:
        if process.poll() is not None:
            raise SystemExit(f"error: {config} exited with {process.returncode} before it was healthy (log {log})")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop(process)
    raise SystemExit(f"error: {config} was not up after 900 s (log {log})")


def stop(process: subprocess.Popen) -> None:
    """Stop a server and every process of its group (vLLM's engine and worker outlived its API server's SIGINT once,
    2026-12-06, and took a core from the next configuration)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever of its group is left
    except ProcessLookupError:
        pass
    process.wait()


def bench(url: str, model: str, tokenizer: str, dataset: Path, n: int, concurrency: int, output_len: int,
          out: Path, name: str, category: str | None = None) -> dict:
    only = ["--spec-bench-category", category] if category else []
    cmd = [str(VLLM_PY), str(ROOT / "scripts" / "vllm_bench_serve.py"), "--backend", "openai-chat", "--base-url", url,
           "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer, "--dataset-name",
           "spec_bench", "--dataset-path", str(dataset), *only, "--num-prompts", str(n), "--disable-shuffle",
           "--spec-bench-output-len", str(output_len), "--max-concurrency", str(concurrency), "--temperature", "0",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"{name}.json",
           "--disable-tqdm", "--seed", "0"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"error: vllm bench serve failed on {name}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    return json.loads((out / f"{name}.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["ours:ar", "ours:verify_width", "ours:budget", "vllm:ar",
                                                      "vllm:dflash", "vllm:joint"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--vllm-args", nargs="*", default=[],
                    help="overrides for vLLM's servers (conf/serve_vllm.yaml), e.g. vllm.max_num_seqs=64")
    ap.add_argument("--by-category", action="store_true",
                    help="also run each category alone at concurrency 1 (its tokens/s and acceptance length)")
    ap.add_argument("--source", default=str(ROOT.parent / "shared" / "data" / "spec_bench.jsonl"))
    ap.add_argument("--tokenizer", default=str(ROOT / "data" / "cache" / "smollm2-135m-instruct"))
    ap.add_argument("--out", default=str(ROOT / "data" / "bench" / "side_by_side"))
    args = ap.parse_args(argv)
    if not VLLM_PY.exists():
        raise SystemExit("error: no .venv-vllm: run make vllm (and make bench-tools) first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dataset, categories = write_sample(Path(args.source), args.per_category, out)
    n, url = len(categories), f"http://127.0.0.1:{args.port}"
    results: dict[str, dict[int, dict]] = {}
    per_category: dict[str, dict[str, dict]] = {}
    for config in args.configs:
        process = start(config, args.port, out / f"{config.replace(':', '-')}.log", args.vllm_args)
        try:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            for c in args.concurrency:
                name = f"{config.replace(':', '-')}-c{c}"
                before = scrape(url)
                result = bench(url, model, args.tokenizer, dataset, n, c, args.output_len, out, name)
                after = scrape(url)
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                ttft_n = d.get("vllm:time_to_first_token_seconds_count", 0.0)
                result["server_ttft_ms"] = (1e3 * d.get("vllm:time_to_first_token_seconds_sum", 0.0) / ttft_n
                                            if ttft_n else None)
                results.setdefault(config, {})[c] = result
                print(f"{name}: {result['output_throughput']:.2f} tok/s, TTFT {result['mean_ttft_ms']:.1f} ms "
                      f"(server {result['server_ttft_ms']}), TPOT {result['mean_tpot_ms']:.2f} ms, acceptance "
                      f"{result.get('spec_decode_acceptance_length')}", flush=True)
            if args.by_category:  # each category alone at concurrency 1: its own tokens/s and acceptance
                for cat in sorted(set(categories)):
                    name = f"{config.replace(':', '-')}-{cat}"
                    result = bench(url, model, args.tokenizer, dataset, categories.count(cat), 1, args.output_len, out,
                                   name, cat)
                    per_category.setdefault(config, {})[cat] = result
                    print(f"{name}: {result['output_throughput']:.2f} tok/s, acceptance "
                          f"{result.get('spec_decode_acceptance_length')}", flush=True)
        finally:
            stop(process)
    reference = results.get("ours:ar", {}).get(min(args.concurrency), {}).get("generated_texts")
    summary = {"categories": categories, "configs": {}}
    print(f"\nSpec-Bench sample: {n} prompts ({args.per_category} per category, {len(set(categories))} categories), "
          f"{args.output_len} output tokens, T=0\n")
    print("| server | concurrency | output tok/s | TTFT ms (server's own) | TPOT ms | acceptance length | text = our ar |")
    print("|---|---|---|---|---|---|---|")
    for config, per_c in results.items():
        for c, r in per_c.items():
            texts = r.get("generated_texts") or []
            same = sum(a == b for a, b in zip(texts, reference)) if reference else None
            al = r.get("spec_decode_acceptance_length")
            sttft = r.get("server_ttft_ms")
            print(f"| {config} | {c} | {r['output_throughput']:.2f} | {r['mean_ttft_ms']:.1f} "
                  f"({'n/a' if sttft is None else f'{sttft:.1f}'}) | {r['mean_tpot_ms']:.2f} | "
                  f"{'n/a' if al is None else f'{al:.3f}'} | {'n/a' if same is None else f'{same}/{len(texts)}'} |")
            summary["configs"].setdefault(config, {})[c] = {k: r.get(k) for k in (
                "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "spec_decode_acceptance_length", "server_ttft_ms",
                "completed")} | {"text_equal_to_ours_ar": same}
    c1 = min(args.concurrency)
    cats = sorted(set(categories))
    print(f"\nPer category at concurrency {c1}: mean TTFT ms / mean TPOT ms\n")
    print("| server | " + " | ".join(cats) + " |")
    print("|---|" + "---|" * len(cats))
    for config, per_c in results.items():
        r = per_c.get(c1)
        if not r or not r.get("ttfts"):
            continue
        cells = []
        for cat in cats:
            idx = [i for i, x in enumerate(categories) if x == cat]
            ttft = sum(r["ttfts"][i] for i in idx) / len(idx) * 1e3
            tpots = [(sum(r["itls"][i]) / max(1, len(r["itls"][i]))) * 1e3 for i in idx if r["itls"][i]]
            cells.append(f"{ttft:.0f} / {sum(tpots) / len(tpots):.1f}" if tpots else f"{ttft:.0f} / n/a")
        print(f"| {config} | " + " | ".join(cells) + " |")
    if per_category:
        print("\nEach category alone at concurrency 1: output tok/s / acceptance length\n")
        print("| server | " + " | ".join(cats) + " |")
        print("|---|" + "---|" * len(cats))
        for config, per_cat in per_category.items():
            cells = []
            for cat in cats:
                r = per_cat.get(cat) or {}
                al = r.get("spec_decode_acceptance_length")
                cells.append(f"{r.get('output_throughput', float('nan')):.1f} / {'-' if al is None else f'{al:.2f}'}")
            print(f"| {config} | " + " | ".join(cells) + " |")
        summary["per_category"] = {c: {cat: {k: r.get(k) for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms",
                                                                     "spec_decode_acceptance_length")}
                                       for cat, r in per_cat.items()} for c, per_cat in per_category.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
