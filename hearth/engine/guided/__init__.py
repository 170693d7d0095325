"""Guided decoding: grammars compiled from JSON schemas, regexes and grammars (grammar.py, on
xgrammar), the grammar pool that compiles off the engine thread, schema helpers, limits."""
