"""Tensor and pipeline parallelism: the driver's executor, the other ranks' process, what they share.

See docs/parallelism.md. Entry points: `hearth.engine.executor.make_executor` (the engine) and
`hearth.engine.parallel.rank.serve_rank` (every rank but the driver).
"""
