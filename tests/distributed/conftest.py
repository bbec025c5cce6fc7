import sys
from pathlib import Path

# The shared models and references live one folder up (tests/helpers.py); spawned worker
# processes inherit this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
