"""Deprecated alias of ``curvalign_lab.results`` (the studies' page writer, which moved with the
studies into the sibling package ``curvalign_lab``): ``python -m curvalign.report.results ...``
still runs it, with a warning; use ``python -m curvalign_lab.results ...``."""

import sys
import warnings

from curvalign_lab import results as _results

warnings.warn(
    "curvalign.report.results moved to curvalign_lab.results (python -m curvalign_lab.results); "
    "this alias will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    raise SystemExit(_results.main())
sys.modules[__name__] = _results
