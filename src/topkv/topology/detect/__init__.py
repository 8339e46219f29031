"""Pure parsers of tool output (text in, records out) and the probes that collect it."""
