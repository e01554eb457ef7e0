"""``python -m adaptive ...``: the same as the ``adaptive`` console command (see :mod:`adaptive.cli`)."""

import sys

from adaptive.cli import main

sys.exit(main())
