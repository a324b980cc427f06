"""Dynamo integration: the model directory, the worker component, its metrics."""

# Where Dynamo processes bind and advertise their request, response, event and system servers:
# loopback only (Dynamo 1.6.1's direct ZMQ event publisher still binds 0.0.0.0 and advertises this).
LOOPBACK_ENV = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
}
