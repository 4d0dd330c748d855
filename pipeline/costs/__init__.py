"""The cost model: what a decoding step costs on this machine, as data. The bottom layer of the package.

* ``curves``: the one curve fit (``interp``, ``monotone``) and the shape check of a measured table (``suspect_points``);
* ``model``: the batch-1 model (``CostModel``: step ms by verify width and context), reading a stored one (``load``);
* ``batched``: the batched step (``BatchCostModel``: step ms by verified rows, drafted rows and requests);
* ``timer``: the one timer of every per-machine measurement (named points, interleaved rounds, least + spread);
* ``store``: the one per-machine cache of measurements (keyed, atomic, refused when a check of it fails);
* ``monitor``: the run-time check of observed against modelled times (``DriftMonitor``) and the correction of a
  verify curve by observed step times (``ObservedCosts``);
* ``margin``: the drafting gate's margin (``GATE_MARGIN``), the one value of every gate and of the vLLM plugin's setting.

Nothing here imports torch or any module of the project above it: the measuring harness, which runs the models, is
``pipeline.timing`` (above decoding), and the vLLM plugin reads this package in vLLM's own process.
"""

from pipeline.costs.batched import BatchCostModel, check_batch_cost_settings
from pipeline.costs.curves import interp, monotone, suspect_points
from pipeline.costs.margin import GATE_MARGIN
from pipeline.costs.model import CACHE_PREFIX, FIT, PARTS, CostModel, identity, load, steps_of
from pipeline.costs.monitor import DriftMonitor, ObservedCosts
from pipeline.costs.timer import Timing, retime, time_points

__all__ = ["BatchCostModel", "CACHE_PREFIX", "CostModel", "DriftMonitor", "FIT", "GATE_MARGIN", "ObservedCosts", "PARTS",
           "Timing", "check_batch_cost_settings", "identity", "interp", "load", "monotone", "retime", "steps_of",
           "suspect_points", "time_points"]
