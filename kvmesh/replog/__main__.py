"""``python -m kvmesh.replog`` runs one replica (same options as ``kvmesh.replog.net.server``)."""

import sys

from .net.server import main

sys.exit(main())
