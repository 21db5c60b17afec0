"""Workers: processes (or in-process threads) that run the rollout core, and the pool that runs them."""

__all__: list[str] = []
