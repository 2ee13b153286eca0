"""kvmesh.replog.net."""
