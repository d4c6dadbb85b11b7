"""Helpers the tests share: fixtures' building blocks, servers, waits, one module a topic.
Test modules import from here (or conftest), never from one another; `waiting.until` is the
tests' one wait for a state (tests/test_layers.py checks both)."""
