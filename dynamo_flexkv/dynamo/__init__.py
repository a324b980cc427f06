"""Dynamo integration: model directory, (next) the worker component and serve graphs."""
