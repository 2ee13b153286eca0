"""kvmesh.replog.storage."""
