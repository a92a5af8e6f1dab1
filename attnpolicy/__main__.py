import sys

from attnpolicy.cli import main

sys.exit(main())
