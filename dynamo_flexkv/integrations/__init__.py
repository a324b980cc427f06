"""What connects the core to serving: the Dynamo worker component, KV events, the disaggregation
roles, the reference engine and the vLLM connector. Imports the core, never the apps."""
