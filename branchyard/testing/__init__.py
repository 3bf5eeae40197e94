"""Tools for testing your own graph transforms.

* :func:`assert_equivalent` -- drive every branch of every ``cond``/``switch``
  of a program and compare it with its rewrite, path by path.
* :mod:`branchyard.testing.strategies` -- hypothesis strategies that build
  random nested ``cond`` trees (import it only where hypothesis is installed;
  this package itself does not need hypothesis).
"""

from branchyard.testing.equivalence import (
    ControlSite,
    Decision,
    EquivalenceReport,
    IncompleteCoverageError,
    assert_equivalent,
    find_control_sites,
    format_path,
    run_recording,
)

__all__ = [
    "ControlSite",
    "Decision",
    "EquivalenceReport",
    "IncompleteCoverageError",
    "assert_equivalent",
    "find_control_sites",
    "format_path",
    "run_recording",
]
