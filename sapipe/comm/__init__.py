"""Communication back-ends behind one narrow interface: start a bucket, get a handle; wait.

The engine never touches ``torch.distributed`` directly, so a back-end (plain all-reduce,
push-pull, Horovod) is one small class.
"""
from .torch_backend import AllReduce, Handle

__all__ = ["AllReduce", "Handle"]
