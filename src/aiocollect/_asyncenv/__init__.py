"""Async envs as tasks: ``AsyncEnvCollector`` (one event loop, a policy call batching the ready envs) and
``MultiAsyncEnvCollector`` (one such engine in each worker process)."""

__all__: list[str] = []
