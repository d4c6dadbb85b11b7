"""Causal replication of event logs across locations, in the style of Eventuate, with the
extended system model (replication filters safe on cycles, event deletion bounded by deletion
version vectors, disaster recovery, location addition and retirement, fail-over), built on
gazette-py's journals and exactly-once consumers. Its vocabulary is the seed's: location, local
event log, CVV, DVV, causality filter, replication progress, topology history.
"""
