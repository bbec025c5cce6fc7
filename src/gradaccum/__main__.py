import sys

from gradaccum.app.cli import main

sys.exit(main())
