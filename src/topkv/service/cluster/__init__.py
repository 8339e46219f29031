"""A local cluster: the process supervisor and ``topkv cluster up`` (:mod:`.local`) and the
cluster's token files (:mod:`.tokens`)."""
