"""The fault campaign (`nox -s faults`, `python -m tests.faults`): a harness of etcd, a fragment
store and five broker processes (`harness`, `network`), a recorded workload (`workload`), fault
scenarios (`scenarios`), and a history checker in the spirit of Jepsen's (`history`, `checker`).
The short scenarios of `tests/test_faults.py` and the checker's own tests share it."""
