"""Model families: one folder each (its names, config parsing, modules, weight loading)."""
