"""How many examples a slow property test draws.

The default run (the README's test command, CI) draws a third of a slow property test's
full count, at least three, besides its explicit ``@example`` cases: the default run keeps
near ten minutes on two cores (11:33 on the 2-core VM at stop 66, 17:11 before) and every
property still runs on fresh random draws each time. ``GRAPHCKPT_THOROUGH=1`` draws the
full count, as the runs before stop 66 did (a few minutes more). Property tests whose examples take well under a second in
all keep a fixed count. A test of 12 examples draws 4 by default, 12 when thorough.
"""

from __future__ import annotations

import os

THOROUGH = os.environ.get("GRAPHCKPT_THOROUGH", "") not in ("", "0")
DEFAULT_SHARE = 3  # the default run draws 1/DEFAULT_SHARE of a test's full count
LEAST = 3


def examples(full: int) -> int:
    """Hypothesis's ``max_examples`` for a test whose full count is ``full``: all of it in a
    thorough run, a third (at least :data:`LEAST`, at most ``full``) by default."""
    return full if THOROUGH else min(full, max(LEAST, full // DEFAULT_SHARE))
