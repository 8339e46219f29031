"""``topkv demo``: a real model end to end, prefill and decode in separate processes.

A local cluster of real worker processes (2 prefill, 2 decode) placed on an emulated
two-node 8x H100 NV18 topology; each request's prefill streams its KV cache layer by layer
to a decode worker over the transport the selection policy picks; decode continues there and
its tokens are compared with a single-process run. See docs/demo.md.
"""

from topkv.demo.errors import DemoError

__all__ = ["DemoError"]
