"""Pure planning: which holder serves which chunk to which reader, given topology."""

from .plan import LEVELS, Candidate, PlanResult, Place, choose, groups, level_between

__all__ = ["LEVELS", "Candidate", "PlanResult", "Place", "choose", "groups", "level_between"]
