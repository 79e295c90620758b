"""The device seam: ``DeviceModule`` (protocol), ``CudaDevice`` (real), ``SimDevice`` (simulated).

Data flows through it as stream work: ``launch`` a copy -> ``Event.record`` -> another stream
``wait``s -> ``query``/``synchronize``. On ``SimDevice`` nothing runs until ``advance``.
"""

from hicache_ref.device.cuda import CudaDevice, cuda_available
from hicache_ref.device.protocol import DeviceModule, Event, OpKind, Stream
from hicache_ref.device.sim import ExecutedOp, SimDeadlock, SimDevice, SimEvent, SimStream

__all__ = [
    "CudaDevice",
    "DeviceModule",
    "Event",
    "ExecutedOp",
    "OpKind",
    "SimDeadlock",
    "SimDevice",
    "SimEvent",
    "SimStream",
    "Stream",
    "cuda_available",
]
