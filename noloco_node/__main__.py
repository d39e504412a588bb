"""``python -m noloco_node`` runs the ``noloco-node`` command line.

The command line is imported only when this runs as the program: a process that multiprocessing spawns from it
(the references of `bench exchange`) imports this module again as ``__mp_main__``, and must not pay for the whole
command line (torch, hivemind) when its function needs none of it."""

import sys

if __name__ == "__main__":
    from noloco_node.cli.main import main

    sys.exit(main())
