"""Assignment of items (journals, shards) to members (brokers, consumers) through etcd."""
