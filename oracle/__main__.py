"""`python -m oracle`: the same command line as the `oracle` script."""

import sys

from oracle.cli import main

sys.exit(main())
