"""`python -m examples.rides`: the whole Rocket Rides pipeline in one command (see pipeline.py)."""

import sys

from examples.rides.pipeline import main

sys.exit(main())
