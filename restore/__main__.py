"""``python -m restore``: the same as the ``tierckpt-restore`` command."""

import sys

from .cli import main

sys.exit(main())
