"""Concurrent replay of the Mooncake conversation trace against served graphs (``dynamo-flexkv
replay``; the main job ``dynamo-flexkv demo`` is its default comparison).

client.py   the async streaming HTTP client: arrivals, concurrency, TTFT, inter-token latency,
            worker and cached tokens per response
configs.py  the configurations compared and serving one through the launcher
report.py   per-configuration statistics, the markdown tables, goodput, the rows' medians and spread,
            JSON lines, the accounting check against the workers' counters
accounting.py  where every prompt token went: loaded per tier, or computed and why
events.py   the workers' KV events, subscribed to as Dynamo's vLLM worker does
plots.py    PNGs
main.py     the command
"""
