"""Topology discovery: the model, tool-output parsers, probes and path classification."""
