"""A local vLLM prefill/decode stack: the launcher, the model, the instances
(``topkv vllm up``), and the demo and benchmark runners built on them."""
