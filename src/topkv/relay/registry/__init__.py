"""The worker registry: its interface (:mod:`.base`), the embedded backend and the URL opener
(:mod:`.memory`), and the etcd backend with its access and session (:mod:`.etcd`)."""
