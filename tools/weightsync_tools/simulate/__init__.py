"""``weightsync simulate``: a cluster-scale timing model of one weight sync, built on the real planner.

Pure functions over frozen dataclasses; no I/O (the plot lives in :mod:`weightsync_tools.simulate.plot`).
"""

from weightsync_tools.simulate.hardware import H100_IB, Hardware
from weightsync_tools.simulate.model import ModeResult, Simulation, geometry, simulate, stage_spec
from weightsync_tools.simulate.models import MODELS, ModelSpec
from weightsync_tools.simulate.scenario import PRESETS, SCENARIOS, Published, Scenario

__all__ = [
    "H100_IB",
    "MODELS",
    "PRESETS",
    "SCENARIOS",
    "Hardware",
    "ModeResult",
    "ModelSpec",
    "Published",
    "Scenario",
    "Simulation",
    "geometry",
    "simulate",
    "stage_spec",
]
