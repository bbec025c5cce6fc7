"""``python -m gradaccum``: the command, as its console script runs it."""

import sys

from gradaccum.app.cli import main
from gradaccum.app.process import EXIT_INTERRUPTED, leave

code = main()
if code == EXIT_INTERRUPTED:
    # A Ctrl-C handled (one line said, exit 130): under `python -m`, CPython can still end the
    # process by SIGINT after it (seen once in four interrupts while planning), which a
    # shell reads as a different status. Leave with the documented one.
    leave(code)
sys.exit(code)
