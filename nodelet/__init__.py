"""The node agent: registers a node's GPUs, runs the work the gateway leases to it."""
