"""CuPy arrays in, CuPy arrays out: the public functions accept ``cupy.ndarray`` inputs.

Arrays cross over through DLPack (no copies) and the kernel runs on CuPy's current stream, so
work queued by CuPy before the call is ordered before the kernel. Results come back as CuPy
arrays sharing the memory torch allocated. CuPy has no bfloat16, so CuPy callers use float16.
"""

import functools
import sys

import torch


def _is_cupy(x) -> bool:
    # Torch tensors and plain Python values first: cheap, and traceable by torch.compile.
    if x is None or isinstance(x, (torch.Tensor, bool, int, float, tuple, list)):
        return False
    return type(x).__module__.split(".")[0] == "cupy"


#: Argument types that are never CuPy arrays: a call made of them alone is passed straight on
#: (where CuPy is imported the check runs on every call, so it is one set operation).
_PLAIN_TYPES = frozenset((torch.Tensor, type(None), bool, int, float, tuple, list))


def accepts_cupy(fn):
    """Let ``fn`` (a torch function) take CuPy arrays for any tensor argument."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # A process that has not imported CuPy holds no CuPy array: one dict lookup, where
        # the types' check costs about 1 us of a planned call's host time.
        if "cupy" not in sys.modules or (_PLAIN_TYPES.issuperset(map(type, args)) and
                                         _PLAIN_TYPES.issuperset(map(type, kwargs.values()))):
            return fn(*args, **kwargs)
        arrays = [a for a in (*args, *kwargs.values()) if _is_cupy(a)]
        if not arrays:
            return fn(*args, **kwargs)
        import cupy

        def to_torch(a):
            return torch.from_dlpack(a) if _is_cupy(a) else a

        args = [to_torch(a) for a in args]
        kwargs = {name: to_torch(a) for name, a in kwargs.items()}
        device = torch.device("cuda", arrays[0].device.id)
        with cupy.cuda.Device(device.index):
            stream = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr, device=device)
            with torch.cuda.stream(stream):
                result = fn(*args, **kwargs)

        def to_cupy(t):
            return cupy.from_dlpack(t) if isinstance(t, torch.Tensor) else t

        return tuple(map(to_cupy, result)) if isinstance(result, tuple) else to_cupy(result)

    return wrapper
