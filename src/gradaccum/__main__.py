import sys

from gradaccum.cli import main

sys.exit(main())
