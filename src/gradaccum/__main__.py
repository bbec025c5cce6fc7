import os
import sys

from gradaccum.app.cli import main

code = main()
if code == 130:
    # A Ctrl-C handled (one line said, exit 130): under `python -m`, CPython can still end the
    # process by SIGINT after it (seen once in four interrupts while planning), which a
    # shell reads as a different status. Leave with the documented one.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)
sys.exit(code)
