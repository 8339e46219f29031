"""Discrete-event cluster simulator for disaggregated LLM inference.

It models a cluster's interconnect (links shared max-min fair by concurrent KV transfers),
a roofline compute model with continuous batching, real request traces, and calls the very
same transport-selection and routing policies as the live runtime, with simulated time
injected through a clock object. See ``docs/simulator.md``.
"""
