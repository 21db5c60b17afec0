"""Workers: processes (or in-process threads) that run the rollout core, and the wire to them."""
