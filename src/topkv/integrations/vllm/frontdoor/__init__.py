"""The OpenAI-compatible front door over vLLM instances: the router, the prefill/decode
picker, the streamed relay of answers, the remote registry and the front door's ADP."""
