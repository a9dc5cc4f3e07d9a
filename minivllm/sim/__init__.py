"""Production scale on a laptop: the real scheduler and block manager, a cost model for the GPU."""

from minivllm.sim.cost_model import CostModel
from minivllm.sim.engine import SimEngine, SimulatedRunner

__all__ = ["CostModel", "SimEngine", "SimulatedRunner"]
