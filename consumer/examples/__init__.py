"""Example consumer applications, each runnable: `python -m consumer.examples.NAME --help`."""
