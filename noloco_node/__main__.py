"""``python -m noloco_node`` runs the ``noloco-node`` command line."""

import sys

from noloco_node.cli import main

sys.exit(main())
