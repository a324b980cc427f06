"""The node cache: one service per node owns the tiers every engine and rank on the node shares
(docs/NODE_CACHE.md). protocol.py is the wire format, channel.py one framed connection, server.py
and session.py the service, engines.py an attached engine's device as the service's transfers see it,
mirror.py the KV events every engine publishes, client.py NodeOffload, the engine side."""
