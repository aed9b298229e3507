"""Suite-wide settings.

Under CI (the `CI` environment variable, set by the CI runner) hypothesis
derandomizes: every run tries the same examples, so a run's verdict depends on
the change under test, not on the draw. Local runs keep exploring new examples
(and remember failures in .hypothesis/).
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
