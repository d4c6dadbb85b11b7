"""Test harness for gazette-py and for applications that embed brokers in their own tests."""

from broker.testing.etcd import EtcdServer, find_etcd_binary, free_port

__all__ = ["EtcdServer", "find_etcd_binary", "free_port"]
