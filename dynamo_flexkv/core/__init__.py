"""The core: hashing, layout, config, tasks, the KV manager, the tier index, storage, transfer and
the remote tier. It imports neither Dynamo, an engine nor the apps."""
