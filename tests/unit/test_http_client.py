"""The one HTTP client of the apps (core/http_client.py): a JSON request against a real local
server, and a Prometheus page's samples summed as serve's tests, the replay and bench events read
them (counters, labels, vLLM's ``vllm:`` names)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dynamo_flexkv.core.http_client import MetricsUnreachable, http_json, metrics_url, scrape, sums_by, total
from dynamo_flexkv.core.sysutil import free_port

PAGE = """# HELP flexkv_requests Requests finished
# TYPE flexkv_requests counter
flexkv_requests_total 7.0
# TYPE flexkv_pool_blocks gauge
flexkv_pool_blocks{tier="host",state="ready"} 3.0
flexkv_pool_blocks{tier="disk",state="ready"} 5.0
flexkv_pool_blocks{tier="disk",state="filling"} 1.0
# TYPE vllm:flexkv_loaded_tokens counter
vllm:flexkv_loaded_tokens_total{engine="0",tier="host"} 32.0
vllm:flexkv_loaded_tokens_total{engine="1",tier="host"} 16.0
# TYPE dynamo_component_kv_cache_events_applied counter
dynamo_component_kv_cache_events_applied{event_type="stored",status="ok",model="a,b"} 4
dynamo_component_kv_cache_events_applied{event_type="removed",status="ok",model="a,b"} 2
"""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGE.encode() if self.path == "/metrics" else json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        got = json.loads(self.rfile.read(int(self.headers["content-length"])))
        body = json.dumps({"method": "POST", "got": got}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_json_get_without_a_body_and_post_with_one(server):
    assert http_json(f"http://127.0.0.1:{server}/health") == {"path": "/health"}
    assert http_json(f"http://127.0.0.1:{server}/x", {"a": 1}) == {"method": "POST", "got": {"a": 1}}


def test_a_metrics_page_is_read_and_summed(server):
    text = scrape(server)
    assert text == scrape(f"http://127.0.0.1:{server}") == scrape(f"http://127.0.0.1:{server}/metrics")
    assert total(text, "flexkv_requests_total") == 7
    assert total(text, "flexkv_pool_blocks", tier="disk") == 6
    assert total(text, "flexkv_pool_blocks", tier="disk", state="ready") == 5
    assert total(text, "flexkv_pool_blocks", tier="device") == 0  # absent: 0, as a counter not incremented yet
    assert total(text, "vllm:flexkv_loaded_tokens_total", tier="host") == 48
    assert sums_by(text, "flexkv_pool_blocks", "tier") == {("host",): 3, ("disk",): 6}
    # a counter whose name has no _total is read as written (Dynamo's router), a value may hold a comma
    applied = "dynamo_component_kv_cache_events_applied"
    assert sums_by(text, applied, "event_type", "status") == {("stored", "ok"): 4, ("removed", "ok"): 2}
    assert total(text, applied, model="a,b") == 6


def test_an_unreachable_page_names_its_url():
    port = free_port("127.0.0.1")
    assert metrics_url(port) == f"http://127.0.0.1:{port}/metrics"
    with pytest.raises(MetricsUnreachable, match=f"http://127.0.0.1:{port}/metrics") as e:
        scrape(port, timeout=2)
    assert isinstance(e.value, OSError) and isinstance(e.value, RuntimeError)  # what its callers catch
