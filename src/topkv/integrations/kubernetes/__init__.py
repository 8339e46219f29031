"""Kubernetes: the Lease backend of leader election, the node-label publisher (needs the
``kubernetes`` extra: lightkube). Only ``topkv.cli`` imports it."""
