"""Planning: which trainer rank writes which inference rank. Pure functions, no I/O."""

from weightsync.plan.document import (
    SCHEMA_VERSION,
    Balance,
    Layout,
    Plan,
    PlanError,
    SourceAssignment,
    Target,
)
from weightsync.plan.planner import layout_of, plan_for, replan

__all__ = [
    "SCHEMA_VERSION",
    "Balance",
    "Layout",
    "Plan",
    "PlanError",
    "SourceAssignment",
    "Target",
    "layout_of",
    "plan_for",
    "replan",
]
