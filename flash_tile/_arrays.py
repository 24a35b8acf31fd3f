"""Arrays passed to a kernel by address: what a planned launch (``flash_tile._plans``) hands
``ct.launch`` in place of a tensor or a view of one.

cuTile takes any object with a CUDA Array Interface as a global array
(docs.nvidia.com/cuda/cutile-python/data.html). A plan knows every array's layout from its
call signature (the shape and strides of the view the kernel reads, the dtype), so a call adds
only the address (``Tensor.data_ptr``, the same for a tensor and its views): no
``transpose`` or ``view`` (about 1.5 us of host time each on a 2-core CPU host, 2026-12-07)
and no DLPack export of it inside ``ct.launch``. The caller keeps the tensors alive until the
launch is queued (they are its inputs and outputs), on the device's current stream as with
tensors; the interface names no stream, so cuTile synchronizes nothing. An address says
nothing of the tensor's layout: a plan passes one only for a call whose key
(``flash_tile._plans.key``: shapes, strides, dtypes, device) equals that of the call the
layout was recorded from.
"""

import torch

#: The interface's type strings of the dtypes planned launches pass. NumPy has no bfloat16:
#: cuTile reads the two-byte void, "<V2" (the string JAX and ml_dtypes give bfloat16), as
#: bfloat16, and refuses other voids ("<V1", "<V4"), so e4m3 has none.
TYPESTRS = {torch.float16: "<f2", torch.bfloat16: "<V2", torch.float32: "<f4",
            torch.int32: "<i4"}


def layout(t: torch.Tensor) -> tuple[tuple, tuple, str]:
    """(shape, strides in bytes, type string) of ``t``: the layout an ``Array`` takes."""
    size = t.element_size()
    return tuple(t.shape), tuple(stride * size for stride in t.stride()), TYPESTRS[t.dtype]


class Array:
    """The array at ``address`` laid out as ``layout`` (``layout()``'s tuple), as cuTile reads
    it: a kernel argument that costs one small dict."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, layout: tuple[tuple, tuple, str], address: int):
        shape, strides, typestr = layout
        self.__cuda_array_interface__ = {"shape": shape, "strides": strides,
                                         "typestr": typestr, "data": (address, False),
                                         "version": 3}


def contiguous(shape: tuple, dtype: torch.dtype) -> tuple[tuple, tuple, str]:
    """The layout (``layout()``'s tuple) of a contiguous array of ``shape`` and ``dtype``."""
    size = dtype.itemsize
    strides = []
    for n in reversed(shape):
        strides.append(size)
        size *= n
    return tuple(shape), tuple(reversed(strides)), TYPESTRS[dtype]
