"""The raise-free allow-list, under its earlier name: it lives in
:mod:`branchyard.fx.raise_free`, where the graph utilities that erase dead
nodes use it too."""

from branchyard.fx.raise_free import RAISE_FREE, RAISE_FREE_METHODS, RaiseFreeRule, may_raise, raise_reason

__all__ = ["RAISE_FREE", "RAISE_FREE_METHODS", "RaiseFreeRule", "raise_reason", "may_raise"]
