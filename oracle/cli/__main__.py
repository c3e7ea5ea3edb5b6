"""`python -m oracle.cli`: the `oracle` command line (how a check runs in a process of its own: the matrix's
workers, a given program's check)."""

import sys

from oracle.cli import main

sys.exit(main())
