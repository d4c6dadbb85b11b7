"""The test kit for consumer applications (upstream's brokertest and consumertest): a real
etcd, brokers and consumers of an application, in the test's process or as processes, journals
and shards created from specs, messages published and committed output read back.

Installing gazette-py registers its pytest plugin (`consumer.testing.plugin`, fixtures named
`gazette_*`); the classes and helpers here serve tests that arrange things themselves. See
docs/applications.md, "Testing an application"."""

from broker.testing import BrokerHarness, BrokerProcess, EtcdServer, start_broker_process
from consumer.testing.harness import ConsumerGroup
from consumer.testing.messages import publish, read_committed_messages
from consumer.testing.processes import ConsumerProcesses, ConsumerProcessesFactory
from consumer.testing.specs import apply_shards, create_journals, journal_spec, shard_spec

__all__ = [
    "BrokerHarness",
    "BrokerProcess",
    "ConsumerGroup",
    "ConsumerProcesses",
    "ConsumerProcessesFactory",
    "EtcdServer",
    "apply_shards",
    "create_journals",
    "journal_spec",
    "publish",
    "read_committed_messages",
    "shard_spec",
    "start_broker_process",
]
