"""The flags several service commands share (auth, TLS and etcd credentials, leader election,
KV tiers), and what they resolve to."""
