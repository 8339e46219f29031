"""A worker's KV memory tiers: device -> host / CXL -> disk (the tiered store, the tier
stores, the device tier, its arenas and the config)."""
