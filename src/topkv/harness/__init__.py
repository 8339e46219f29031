"""Harnesses that drive the library from outside: processes, namespaces, benchmarks.

Above :mod:`topkv.service` in the layer order (cli > harness > demo | sim > service > relay >
transport > ...): nothing in the library imports a harness.

* :mod:`topkv.harness.netns`: a loopback-only private network namespace (NIXL and Mooncake
  bind every interface, so tests and benchmarks run them in one).
* :mod:`topkv.harness.peers`: the two-process peer (``python -m topkv.harness.peers
  sink|send``) the arena transports' tests and benchmarks drive.
* :mod:`topkv.harness.arena_bench`: ``topkv bench transfer --transport nixl|mooncake|cuda``.
* :mod:`topkv.harness.chaos`: ``topkv chaos``, fault injection against a local cluster of
  worker processes (:mod:`~topkv.harness.chaos_inprocess`: the same against the same
  workers started in-process; :mod:`~topkv.harness.chaos_config`: its config and report).
* :mod:`topkv.harness.inprocess_cluster`: real workers (``WorkerService``) started in the
  caller's event loop and registered straight into its registry (tests, chaos).
* :mod:`topkv.harness.validate_live`: ``topkv sim-validate``, the simulator against a
  recorded demo run (it uses both :mod:`topkv.sim` and :mod:`topkv.demo`), with
  :mod:`~topkv.harness.validate_record` (the record), :mod:`~topkv.harness.validate_model`
  (calibration) and :mod:`~topkv.harness.validate_predict` (the simulated demo cluster).
"""
