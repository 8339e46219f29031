"""HTTP and security plumbing every service shares: bearer-token auth, TLS, fencing by
epoch, and request/response helpers."""
