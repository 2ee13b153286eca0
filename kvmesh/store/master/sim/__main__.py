"""``python -m kvmesh.store.master.sim``: a batch of seeds."""

from . import main

raise SystemExit(main())
