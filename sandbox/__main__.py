"""``python -m sandbox`` runs the ``guard`` command."""

import sys

from sandbox.cli import main

sys.exit(main())
