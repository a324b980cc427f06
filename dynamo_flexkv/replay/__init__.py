"""Concurrent replay of the Mooncake conversation trace against served graphs (``dynamo-flexkv
replay``; the main job ``dynamo-flexkv demo`` is its default comparison).

client.py   the async streaming HTTP client: arrivals, concurrency, TTFT, inter-token latency,
            worker and cached tokens per response
configs.py  the configurations compared and serving one through the launcher
report.py   per-configuration statistics, the markdown table, JSON lines, the accounting check
plots.py    PNGs
main.py     the command
"""
