"""Suite-wide guards: nothing in the tests may reach outside this machine."""

import os

# transformers / huggingface_hub must never try the network (the model directory is local).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Dynamo processes bind and advertise loopback only.
for var in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
    os.environ.setdefault(var, "127.0.0.1")
