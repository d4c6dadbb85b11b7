"""Helpers the tests share: fixtures' building blocks, servers, waits. Test modules import from
here, never from one another."""
