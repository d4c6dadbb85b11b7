"""Recovery logs (upstream's `consumer/recoverylog`): a shard's local files recorded operation by
operation into a journal, and the hints that say which parts of the log are live. The recorder,
the player and the log format arrive with the recovery-log issue; the hints come first, since the
Shard service's Apply and GetHints carry them."""
