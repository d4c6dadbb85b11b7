"""Test harness for gazette-py and for applications that embed brokers in their own tests:
a real etcd child process (`EtcdServer`) and in-process brokers (`BrokerHarness`)."""

from broker.local_etcd import EtcdServer, find_etcd_binary, free_port
from broker.processes import stop_process, stop_processes
from broker.testing.harness import BrokerHarness

__all__ = [
    "BrokerHarness",
    "EtcdServer",
    "find_etcd_binary",
    "free_port",
    "stop_process",
    "stop_processes",
]
