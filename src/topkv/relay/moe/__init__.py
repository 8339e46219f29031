"""The orchestrator's MoE routing: the expert registry (:mod:`.experts`) and the decode
routing over it (:mod:`.routing`)."""
