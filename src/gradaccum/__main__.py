"""``python -m gradaccum``: the command, as its console script runs it."""

import sys

from gradaccum.app.process import EXIT_INTERRUPTED, leave, watch_loading

# Ctrl-C is the command's before anything else loads (process.py imports the standard
# library only): the command's own modules take a while to import on a loaded machine.
watch_loading()

from gradaccum.app.cli import main  # noqa: E402 - after the Ctrl-C handler, on purpose

code = main()
if code == EXIT_INTERRUPTED:
    # A Ctrl-C handled (one line said, exit 130): under `python -m`, CPython can still end the
    # process by SIGINT after it (seen once in four interrupts while planning), which a
    # shell reads as a different status. Leave with the documented one.
    leave(code)
sys.exit(code)
