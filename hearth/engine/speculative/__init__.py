"""Speculative decoding: drafts from the request's own context (n-gram and suffix proposers,
`proposers.py`, over an incremental index, `index.py`) or from a draft model
(`draft_model.py`), verified in the same engine step; the `Speculator` (`speculator.py`) holds
the per-request state and the counters. See docs/speculative.md."""
