"""The device seam: ``DeviceModule`` (``protocol``), ``CudaDevice`` (``cuda``: real),
``SimDevice`` (``sim``: simulated), and ``PerturbedDevice`` (``perturb``: a real one, seeded).

Data flows through it as stream work: ``launch`` a copy -> ``Event.record`` -> another stream
``wait``s -> ``query``/``synchronize``. On ``SimDevice`` nothing runs until ``advance``. On a
real GPU a campaign runs on a ``PerturbedDevice`` (``cuda_campaign_device``): seeded spins
before stream work stand in for the simulator's choice of when each op runs.
"""

from hicache_ref.device.cuda import (
    CudaDevice,
    cuda_available,
    cuda_campaign_device,
    require_cuda,
)
from hicache_ref.device.perturb import (
    DEFAULT_PERTURBATION,
    Perturbation,
    PerturbationSchedule,
    PerturbedDevice,
    SpinDecision,
)
from hicache_ref.device.protocol import DeviceModule, Event, OpKind, Stream
from hicache_ref.device.sim import ExecutedOp, SimDeadlock, SimDevice, SimEvent, SimStream

__all__ = [
    "DEFAULT_PERTURBATION",
    "CudaDevice",
    "DeviceModule",
    "Event",
    "ExecutedOp",
    "OpKind",
    "Perturbation",
    "PerturbationSchedule",
    "PerturbedDevice",
    "SimDeadlock",
    "SimDevice",
    "SimEvent",
    "SimStream",
    "SpinDecision",
    "Stream",
    "cuda_available",
    "cuda_campaign_device",
    "require_cuda",
]
