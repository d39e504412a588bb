"""``python -m noloco_node`` runs the ``noloco-node`` command line."""

import sys

from noloco_node.cli.main import main

sys.exit(main())
