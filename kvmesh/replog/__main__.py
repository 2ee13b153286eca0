"""``python -m kvmesh.replog`` runs one replica (same options as ``kvmesh.replog.server``)."""

import sys

from .server import main

sys.exit(main())
