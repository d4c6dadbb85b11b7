"""Benchmarks run by `nox -s bench`. Each reports its figure beside a baseline measured in the
same run on the same machine, and the ratio, because machines here are shared and noisy."""
