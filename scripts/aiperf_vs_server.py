"""AIPerf (``.venv-aiperf``, ``make aiperf``) against a running OpenAI-compatible server (``make serve``, or
``make serve-vllm``), at several concurrencies, each figure beside the server's own: TTFT from AIPerf's stream against
the server's ``vllm:time_to_first_token_seconds`` histogram, and the acceptance length AIPerf reads from the responses
against the server's ``vllm:spec_decode_*`` counters (both scraped from ``/metrics`` before and after each run).

    .venv/bin/python scripts/aiperf_vs_server.py --url http://127.0.0.1:8000 --concurrency 1 4 16 --requests 16 \\
        --input data/bench/spec_bench_aiperf.jsonl --tokenizer data/cache/smollm2-135m-instruct --output-tokens 64

``make bench-tools`` writes ``data/bench/spec_bench_aiperf.jsonl`` (Spec-Bench, AIPerf's single_turn layout). Prints a
Markdown table and writes each run's AIPerf artifacts under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
AIPERF = ROOT / ".venv-aiperf" / "bin" / "python"

from pipeline.serving.metrics import scrape  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="the served model id (default: the server's first /v1/models)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency")
    ap.add_argument("--input", default=str(ROOT / "data" / "bench" / "spec_bench_aiperf.jsonl"))
    ap.add_argument("--tokenizer", required=True, help="the target's tokenizer folder")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "data" / "bench" / "aiperf"))
    args = ap.parse_args(argv)
    if not AIPERF.exists():
        sys.exit(f"error: no {AIPERF.parent.parent.name}: run make aiperf first")
    if not Path(args.input).is_file():
        sys.exit(f"error: no {args.input}: run make bench-tools (Spec-Bench in AIPerf's layout) or pass --input")
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    rows = []
    for c in args.concurrency:
        out = Path(args.out) / f"c{c}"
        before = scrape(args.url)
        cmd = [str(AIPERF), "-m", "aiperf", "profile", "--model", model, "--url", args.url, "--endpoint-type", "chat",
               "--streaming", "--concurrency", str(c), "--request-count", str(args.requests), "--input-file", args.input,
               "--custom-dataset-type", "single_turn", "--tokenizer", args.tokenizer, "--output-tokens-mean",
               str(args.output_tokens), "--extra-inputs", "temperature:0", "--ui", "none", "--random-seed", "0",
               "--artifact-dir", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
            return run.returncode
        after = scrape(args.url)
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        result = json.loads((out / "profile_export_aiperf.json").read_text())
        drafts = d.get("vllm:spec_decode_num_drafts_total", 0.0)
        accepted = d.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
        ttft_n = d.get("vllm:time_to_first_token_seconds_count", 0.0)
        server_ttft = 1e3 * d.get("vllm:time_to_first_token_seconds_sum", 0.0) / ttft_n if ttft_n else float("nan")
        tool_al = (result.get("spec_decode_token_weighted_acceptance_length") or {}).get("avg")
        rows.append((c, int(result["request_count"]["avg"]), result["output_token_throughput"]["avg"],
                     result["time_to_first_token"]["avg"], server_ttft, result["inter_token_latency"]["avg"],
                     tool_al, 1 + accepted / drafts if drafts else None))
    print("| concurrency | requests | output tok/s | TTFT AIPerf ms | TTFT server ms | ITL ms | acceptance AIPerf | "
          "acceptance server |")
    print("|---|---|---|---|---|---|---|---|")
    for c, n, tps, ttft, sttft, itl, al, sal in rows:
        fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
        print(f"| {c} | {n} | {tps:.2f} | {ttft:.1f} | {sttft:.1f} ({100 * (ttft / sttft - 1):+.1f}%) | {itl:.2f} | "
              f"{fmt(al)} | {fmt(sal)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
