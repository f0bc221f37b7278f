"""``python -m spexis_sglang.bench_serving``: SGLang's own ``bench_serving`` from this project.

It takes exactly the arguments of SGLang 0.5.17's ``python -m sglang.benchmark.serving`` and
runs its ``cli_main`` unchanged; on a machine without CUDA it first applies the CPU start-up
hooks (:mod:`spexis_sglang.srt.bench_cli`). Example, against a server of ``make serve`` (SP) or
``make serve-plain`` (plain PP) on :30000::

    .venv/bin/python -m spexis_sglang.bench_serving --backend sglang --port 30000 \\
        --dataset-name random-ids --random-input-len 64 --random-output-len 32 \\
        --num-prompts 40 --request-rate 2 --output-file result.jsonl

``random-ids`` needs no download (random token ids, the tokenizer is the one of the served
model, read from its local directory); ``sharegpt`` and ``random`` need
``--dataset-path`` to a local ShareGPT JSON on machines without internet.
"""

from spexis_sglang.srt.bench_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
