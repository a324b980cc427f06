"""Suite-wide guards: nothing in the tests may reach outside this machine."""

import os

# transformers / huggingface_hub must never try the network (the model directory is local).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Dynamo processes bind and advertise loopback only.
from dynamo_flexkv.dynamo import LOOPBACK_ENV  # noqa: E402

for var, value in LOOPBACK_ENV.items():
    os.environ.setdefault(var, value)
