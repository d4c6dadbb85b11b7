"""Test harness for gazette-py and for applications that embed brokers in their own tests:
a real etcd child process (`EtcdServer`), in-process brokers (`BrokerHarness`) and broker
processes (`start_broker_process`), each stopped by its owner (processes by pid).

Consumer applications' tests get all of it as pytest fixtures from `consumer.testing`."""

from broker.testing.harness import BrokerHarness
from broker.testing.processes import BrokerProcess, start_broker_process
from plumbing.local_etcd import EtcdServer, find_etcd_binary, free_port
from plumbing.processes import stop_process, stop_processes

__all__ = [
    "BrokerHarness",
    "BrokerProcess",
    "EtcdServer",
    "find_etcd_binary",
    "free_port",
    "start_broker_process",
    "stop_process",
    "stop_processes",
]
