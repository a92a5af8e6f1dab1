"""``python -m attnpolicy``: the command line."""

import sys

from attnpolicy.cli import main

sys.exit(main())
