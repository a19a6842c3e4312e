"""Deprecated alias of ``curvalign_lab.kit``: the studies' machinery (``Bench``, the verdict
rule, ``across_seed_bases``) moved out of the importable library into the sibling package
``curvalign_lab`` (installed by the same distribution). Importing this name warns; it goes in
the next release."""

import sys
import warnings

from curvalign_lab import kit as _kit

warnings.warn(
    "curvalign.report.studykit moved to curvalign_lab.kit; this alias will be removed in the "
    "next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _kit
