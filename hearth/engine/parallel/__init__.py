"""Tensor and pipeline parallelism: the driver-side executor, the rank worker, and what they share.

See docs/parallelism.md. Entry points: `hearth.engine.executor.make_executor` (the engine) and
`hearth.engine.parallel.worker.serve_rank` (every rank but the driver).
"""
