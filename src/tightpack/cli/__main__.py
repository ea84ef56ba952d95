"""``python -m tightpack.cli``."""

import sys

from tightpack.cli import main

sys.exit(main())
