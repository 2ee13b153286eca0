"""kvmesh.replog.core."""
