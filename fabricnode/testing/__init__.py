"""Deterministic test doubles shipped with the package (used by tests, benches and the demo)."""
