"""Deterministic simulation of Raft clusters built on the real core.

* :mod:`.harness`: a hand-driven network for unit tests (deliver, cut, isolate, drop).
* :mod:`.cluster` and friends: the seeded discrete-event simulator (virtual clock,
  simulated disks with volatile/durable layers, faulty network, crashes, clients, a
  nemesis) with continuous invariant checks and a linearizability check of every run.

Run a soak with ``python -m kvmesh.replog.sim --seeds 5000``.
"""
