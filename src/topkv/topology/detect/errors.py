"""Errors raised by tool-output parsers."""

from topkv.errors import TopKVError


class ParseError(TopKVError):
    """Tool output could not be parsed; the message names the tool and what was wrong."""


class NoUsableDriverError(ParseError):
    """The tool output is an error message from nvidia-smi: no usable NVIDIA driver/GPU."""
