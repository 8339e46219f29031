"""The Adaptive Decoder Pool's decisions: rush detection, conversion plans (:mod:`.pool`)
and the rules that weigh decode KV memory (:mod:`.memory`). docs/adp.md explains the design."""
