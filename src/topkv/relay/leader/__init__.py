"""Leader election: the backend interface (:mod:`.base`), the election loop (:mod:`.loop`)
and the etcd backend (:mod:`.etcd`); the Kubernetes Lease backend is in
:mod:`topkv.integrations.kubernetes`."""
