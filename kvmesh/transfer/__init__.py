"""kvmesh.transfer: segments, registered memory, batched READ/WRITE, per-segment transports."""
