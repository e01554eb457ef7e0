"""``python -m adaptive ...``: the same as the ``adaptive`` console command (see :mod:`adaptive.observe.cli`)."""

import sys

from adaptive.observe.cli import main

sys.exit(main())
