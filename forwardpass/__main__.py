"""``python -m forwardpass ...``: the ``forwardpass`` command (what
``torchrun -m forwardpass serve`` runs)."""

import sys

from forwardpass.cli import main

sys.exit(main())
