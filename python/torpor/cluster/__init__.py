"""Torpor across nodes, on Ray: one torpord per node, a node agent per node (a Ray actor pinned
to it, wrapping that daemon's API) and an HTTP ingress (Ray Serve) that deploys a function on the
whole cluster and routes each invocation by `torpor.cluster.placement.place`.

Importing this package needs no Ray: `placement` is pure Python (the simulator uses it), and the
modules that need Ray (`agent`, `ingress`, `node`) import it themselves. docs/cluster.md says how
to run it on real machines.
"""
