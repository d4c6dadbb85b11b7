"""`gazctl dev up|down|status|kill|restart`: a local cluster (etcd and N brokers) on loopback; with
`--consumers N --app NAME` also N consumer processes of an application, and with `--postgres` a
PostgreSQL server for SQL stores.

Processes run detached so `up` can return; their pids and addresses live in `<dir>/cluster.json`
and `down` stops exactly those pids (after checking each still runs what we started). The ports
stay in `<dir>/ports.json` after `down`: the next `up` listens on them again where still free,
so an exported BROKER_ADDRESS (every broker, comma-separated: a client reaches whichever is
alive) keeps working.

The package, each module on those before it: `state.py` (the processes recorded in
cluster.json), `security.py` (`--tls` and `--auth`: certificates and key under <dir>),
`ports.py` (ports.json), `supervisor.py` (starting, watching and stopping processes by pid),
`processes.py` (what each kind of process runs), `cluster.py` (starting a cluster, or again the
processes of one that are down), `cli.py` (the commands).
"""

from __future__ import annotations

from gazctl.dev.cli import dev
from gazctl.dev.ports import Ports
from gazctl.dev.security import DevSecurity
from gazctl.dev.state import ClusterState, Proc
from gazctl.dev.supervisor import is_running, process_state, stop_pid, stop_pids

__all__ = [
    "ClusterState",
    "DevSecurity",
    "Ports",
    "Proc",
    "dev",
    "is_running",
    "process_state",
    "stop_pid",
    "stop_pids",
]
