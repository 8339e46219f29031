"""Code for outside engines and platforms (vLLM, Kubernetes).

Each subpackage imports its engine's own libraries; nothing else in topkv imports this
package, so a user without vLLM or a Kubernetes client never needs them.
"""
