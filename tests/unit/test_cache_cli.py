"""``dynamo-flexkv cache`` itself (cache_cli.py) against a node cache service in this process: what it
prints for people and as JSON, its exit codes, and the messages that name the fix."""

from __future__ import annotations

import io
import json

import pytest
from node_helpers import BS, Engine, node_server, prompt

from dynamo_flexkv import cache_cli
from dynamo_flexkv.cache_cli import parse_tokens, run
from dynamo_flexkv.cache_server import serve_metrics
from dynamo_flexkv.cli import build_parser
from dynamo_flexkv.core.inventory import BadCacheRequest
from dynamo_flexkv.core.sysutil import free_port


def cli(*argv: str):
    out = io.StringIO()
    code = run(build_parser().parse_args(["cache", *argv]), out)
    return code, out.getvalue()


@pytest.fixture
def served(tmp_path):
    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05) as server:
        path = server.options.socket_path
        engine = Engine(path, "A", model_id="m1", tenant="acme")
        tokens = prompt(3, 5 * BS + 2)
        engine.store(tokens, list(range(5)))
        assert engine.offload.drain(30)
        port = free_port()
        http = serve_metrics(server, "127.0.0.1", port)
        yield path, f"http://127.0.0.1:{port}", tokens
        http.shutdown()
        engine.offload.shutdown()


def test_show_prefix_and_clear_for_people(served, capsys):
    path, url, tokens = served
    code, text = cli("--socket", path)
    assert code == 0
    assert "cache server pid" in text and f"at {path}" in text
    assert "model m1, tenant acme, 1 engine(s)" in text
    assert "    host  5       0       0" in text and "    disk  5       0       0" in text
    code, text = cli("prefix", "--url", url, "--tokens", " ".join(map(str, tokens + prompt(4, BS))))
    assert code == 0 and "a prompt of 98 tokens, 6 full block(s) of 16" in text
    assert "blocks 0-4     host, disk" in text and "block 5        no tier (computed on a request)" in text
    code, text = cli("clear", "--socket", path, "--tier", "disk", "--wait", "0")
    assert code == 0 and "    disk    5 block(s) cleared" in text and "host" not in text.split("cleared\n", 1)[1]


def test_json_rows_carry_each_answer_or_its_error(served, tmp_path):
    path, url, _ = served
    code, text = cli("--json", "--url", url, "--socket", str(tmp_path / "none.sock"))
    rows = json.loads(text)
    assert code == 1  # one target failed
    assert rows[0]["address"] == url and rows[0]["report"]["contents"][0]["tiers"][0]["blocks"] == 5
    assert rows[1]["address"].endswith("none.sock") and "no cache server socket at" in rows[1]["error"]


def test_usage_errors_name_the_fix(served, capsys):
    path, url, _ = served
    code, _ = cli()
    assert code == 2 and "name what to ask: --url http://127.0.0.1:PORT" in capsys.readouterr().err
    code, _ = cli("prefix", "--socket", path, "--tokens", "1,x,3")
    assert code == 2 and "write token ids as 1,2,3" in capsys.readouterr().err
    code, _ = cli("prefix", "--socket", path, "--text", "hello")
    assert code == 1 and "the cache server has no tokenizer" in capsys.readouterr().err
    code, _ = cli("clear", "--url", url, "--tenant", "nobody")
    err = capsys.readouterr().err
    assert code == 1 and "holds no namespace of tenant 'nobody'; it holds model 'm1' tenant 'acme'" in err
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["cache", "clear", "--url", url, "--tier", "ssd"])
    assert e.value.code == 2 and "invalid choice: 'ssd'" in capsys.readouterr().err
    code, _ = cli("--url", url.replace("http://", "") + "/metrics")  # as serve prints it: still the server
    assert code == 0


def test_a_port_that_is_not_ours_is_named(capsys):
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        code, _ = cli("--url", f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
        httpd.server_close()
    err = capsys.readouterr().err
    assert code == 1 and "neither a dynamo-flexkv worker's system port nor a cache-server's --metrics-port" in err


def test_token_lists():
    assert parse_tokens("1,2, 3") == [1, 2, 3] == parse_tokens("1 2 3") == parse_tokens("[1, 2, 3]")
    with pytest.raises(BadCacheRequest, match="--tokens is empty"):
        parse_tokens(" ")


def test_a_vllm_workers_connector_answers_on_its_lookup_socket(tmp_path, capsys):
    """FlexKVConnector's worker side (its tiers, a KVManager here) answers the same requests on
    its lookup socket; `--vllm DIR` asks every rank's socket in a replica's directory."""
    from kv_helpers import MODEL, TPB, config, device_tensors, fill
    from test_vllm_connector_settings import vllm_config

    from dynamo_flexkv import KVLayoutType, KVManager
    from dynamo_flexkv.core.offload import EmbeddedOffload
    from dynamo_flexkv.integrations.vllm_connector.lookup import LookupServer
    from dynamo_flexkv.integrations.vllm_connector.protocol import lookup_endpoint
    from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings
    from dynamo_flexkv.integrations.vllm_connector.worker import WorkerSide

    side = WorkerSide(ConnectorSettings.from_vllm(vllm_config(tmp_path), None), 0, 1)
    side.offload = EmbeddedOffload(KVManager(MODEL, config(tmp_path), model_id="vllm-m"))
    dev = device_tensors(KVLayoutType.LAYERBLOCK, 16)
    side.offload.register(dev, KVLayoutType.LAYERBLOCK)
    tokens = list(range(3 * TPB))
    for i, h in enumerate(side.offload.block_hashes(tokens)):
        fill(dev, KVLayoutType.LAYERBLOCK, i, h)
    assert side.offload.store(tokens, [0, 1, 2]) is not None and side.offload.drain(30)
    server = LookupServer(lookup_endpoint("e0", str(tmp_path)), lambda *a: 0, None, side.cache_admin)
    try:
        code, text = cli("--vllm", str(tmp_path))
        assert code == 0 and "vLLM worker e0 rank 0 (embedded)" in text and "model vllm-m, no tenant" in text
        code, text = cli("prefix", "--vllm", str(tmp_path), "--tokens", json.dumps(tokens))
        assert code == 0 and "blocks 0-2     host, disk" in text
        code, _ = cli("clear", "--vllm", str(tmp_path), "--tier", "device")
        assert code == 1 and "device tier is vLLM's own prefix cache: clear it with Dynamo's clear_kv_blocks" in (
            capsys.readouterr().err
        )
        code, text = cli("clear", "--vllm", str(tmp_path))
        assert code == 0 and "host    3 block(s) cleared" in text and "disk    3 block(s) cleared" in text
        assert side.offload.cached_tokens(tokens + [1]) == 0
    finally:
        server.close()
        side.offload.shutdown()
    code, _ = cli("--vllm", str(tmp_path))
    # Either message names the directory: which one depends on whether another process (a vLLM
    # engine under a deep run directory, here or in a parallel test) has a socket in the temp dir.
    err = capsys.readouterr().err
    assert code == 1 and "no FlexKVConnector lookup socket" in err and f"in {tmp_path}" in err, err


def test_the_selection_goes_before_or_after_the_action(served):
    path, _, _ = served
    code, text = cli("--tier", "disk", "clear", "--socket", path, "--wait", "0")  # --tier before the action
    assert code == 0 and "    disk    5 block(s) cleared" in text and "host" not in text.split("cleared\n", 1)[1]
    code, text = cli("--tenant", "acme", "--socket", path)  # and with no action (show)
    assert code == 0 and "    host  5" in text and "    disk  0" in text


def test_a_repeatable_flag_on_both_sides_of_the_action_keeps_every_value(served, tmp_path, capsys):
    path, _, _ = served
    code, text = cli("--tier", "disk", "show", "--tier", "host", "--socket", path)
    assert code == 0 and "    host  " in text and "    disk  " in text, text
    args = build_parser().parse_args(
        ["cache", "--socket", "a", "--tier", "disk", "show", "--socket", "b", "--socket", "a"]
    )
    assert cache_cli._repeated(args, "socket") == ["a", "b"] and cache_cli._repeated(args, "tiers") == ["disk"]
    missing = str(tmp_path / "gone.sock")
    code, text = cli("--socket", path, "show", "--socket", missing)  # both asked: the missing one errs
    assert code == 1 and path in text and f"{missing}: error: " in capsys.readouterr().err, text


def test_bad_targets_and_values_exit_2_naming_the_flag(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for argv, said in (
        (["--url", "http://127.0.0.1:99999"], "--url http://127.0.0.1:99999: the port '99999' is not 1-65535"),
        (["--url", "127.0.0.1:x8"], "--url 127.0.0.1:x8: the port 'x8' is not 1-65535"),
        (["--url", "ftp://127.0.0.1:21"], "the scheme ftp:// is not http"),
        (["--url", "http://[::1"], "--url http://[::1: Invalid IPv6 URL: write http://HOST:PORT"),
        (["--socket", str(a_file)], f"--socket {a_file} is a regular file, not a socket"),
        (["--socket", str(tmp_path)], f"--socket {tmp_path} is a directory, not a socket"),
        (["clear", "--wait", "-3", "--socket", str(tmp_path / "x.sock")], "--wait -3: wait 0 to 600 seconds"),
    ):
        code, _ = cli(*argv)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and said in err and "wait_s" not in err, (argv, err)


def test_a_prefix_on_an_empty_cache_server_says_nothing_is_cached(tmp_path):
    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05) as server:
        code, text = cli("prefix", "--socket", server.options.socket_path, "--tokens", "1,2,3")
    assert code == 0 and "nothing attached yet: no namespace, so no block of this prompt is cached" in text, text
