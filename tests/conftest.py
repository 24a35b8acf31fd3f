"""GPU tests carry the ``gpu`` marker and are skipped, with the reason, where they cannot run.

The tests run the fixed default variants (no autotuning, which would time a dozen variants per
shape class, whatever the environment says); ``tests/test_gpu_variants.py`` checks every
registered variant and the tuner. Outputs the ops allocate are filled with NaN in GPU tests
before the kernels run, so an element a kernel never writes cannot pass for a result.
"""

import functools
import os
import sys
from pathlib import Path

# ``python -m pytest`` puts the working directory first on sys.path, and from the checkout's
# root its ``kernels/`` (installed as ``flash_tile.kernels``) would shadow the ``kernels``
# distribution that Transformers 5 imports. The installed package does not need the root.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ["FLASH_TILE_AUTOTUNE"] = "0"

# The compute capability whose registered variants the variant tests are collected for: this
# GPU's, or sm_90's where no supported GPU is (those tests then skip).
VARIANTS_CAPABILITY = (torch.cuda.get_device_capability() if torch.cuda.is_available() and
                       torch.cuda.get_device_capability() >= (8, 0) else (9, 0))


@functools.cache
def gpu_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch on this machine"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 0):
        return f"the GPU has compute capability {major}.{minor}; flash_tile needs 8.0+"
    from flash_tile._validate import find_tileiras

    if find_tileiras() is None:
        return "the cuTile compiler (tileiras) is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def launched(monkeypatch):
    """The (grid, kernel, args) of every ``ct.launch`` that ``flash_tile._launch`` (and so
    ``_launch_decode`` and ``_plans``) makes, recorded on the CPU instead of run."""
    from contextlib import nullcontext

    from flash_tile import _launch

    calls = []
    monkeypatch.setattr(_launch.ct, "launch",
                        lambda stream, grid, kernel, args, **attributes: calls.append(
                            (grid, kernel, args)))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "device", lambda device: nullcontext())
    return calls


@pytest.fixture
def hopper_or_newer():
    """Skips on a GPU older than sm_90: tileiras 13.4 compiles no float8_e4m3fn code for
    it (the FP8 forward, an FP8 KV cache)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 (float8_e4m3fn) needs compute capability 9.0+ (tileiras 13.4)")


def array_interface(t: torch.Tensor) -> dict:
    """The CUDA Array Interface of ``t`` (strides in bytes), as a planned launch passes it."""
    typestr = {torch.float32: "<f4", torch.bfloat16: "<V2", torch.float16: "<f2",
               torch.int32: "<i4"}[t.dtype]
    return {"shape": tuple(t.shape), "strides": tuple(s * t.element_size() for s in t.stride()),
            "typestr": typestr, "data": (t.data_ptr(), False), "version": 3}


def opcheck_fp8(op, args):
    """``torch.library.opcheck`` of an op with float8 inputs: torch's schema check compares
    each input before and after the call with ``allclose``, which has no float8 kernel, so it
    is replaced here by its mutation half, the inputs' bytes before and after."""
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    op(*args)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    for old, new in zip(before, after):  # float8 compared as bytes
        assert torch.equal(*(t.view(torch.uint8) if t.element_size() == 1 else t
                             for t in (old, new))), "an input changed"
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration",
                                                "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.fixture(autouse=True)
def poisoned_outputs(request, monkeypatch):
    """In GPU tests, the ops' output buffers start as NaN instead of whatever memory held."""
    if request.node.get_closest_marker("gpu"):
        poison_outputs(monkeypatch.setattr)


def poison_outputs(patch=setattr):
    """Make the allocators of the ops' outputs and workspaces fill them with NaN (e4m3's NaN
    bytes for V^T), through ``patch``: a monkeypatch's ``setattr``, or the builtin in a
    process that a GPU test spawns."""
    from flash_tile import _launch, _launch_decode, _ops, _ops_decode, _plans

    def poisoned(allocate):
        def allocate_nan(*args, **keywords):
            outputs = allocate(*args, **keywords)
            for t in outputs:
                if t is not None:
                    t.fill_(float("nan"))
            return outputs
        return allocate_nan

    def poisoned_tensor(allocate):
        return lambda *args: allocate(*args).fill_(float("nan"))

    patch(_ops, "_forward_outputs", poisoned(_ops._forward_outputs))
    patch(_plans, "outputs", poisoned(_plans.outputs))
    patch(_ops, "_backward_outputs", poisoned(_ops._backward_outputs))
    patch(_ops_decode, "_decode_outputs", poisoned(_ops_decode._decode_outputs))
    patch(_launch_decode, "decode_workspace", poisoned_tensor(_launch_decode.decode_workspace))
    # The rotated q: the append must write every element the decode reads.
    patch(_ops_decode, "rotated_q_workspace",
          poisoned_tensor(_ops_decode.rotated_q_workspace))
    # The sinks' shares: NaN where every program must store (the varlen zeros are meant).
    workspace = _launch.sinks_workspace
    patch(_launch, "sinks_workspace", lambda shape, varlen, device: (
        workspace if varlen else poisoned(workspace))(shape, varlen, device))
    # Delta: the dQ (or preprocess) kernel must store every row the dK/dV kernel reads.
    patch(_launch, "delta_workspace", poisoned_tensor(_launch.delta_workspace))
    # The FP8 forward's V^T: e4m3's NaN bytes (0x7F) where the copy must write.
    workspace_of = _launch.keys_major_workspace
    patch(_launch, "keys_major_workspace", lambda v: _poison_bytes(workspace_of(v)))
    patch(_ops, "_varlen_outputs", poisoned(_ops._varlen_outputs))
    patch(_ops, "_varlen_gradients", poisoned(_ops._varlen_gradients))


def _poison_bytes(t):
    t.view(torch.uint8).fill_(0x7F)
    return t


@pytest.fixture(params=["two_pass", "one_pass"])
def backward_form(request, monkeypatch):
    """Runs a test under each backward form, made the default of every head dim for the test:
    the two passes (what ``deterministic`` runs) and the one-pass form (dQ by TMA
    reduce-adds). The one pass is registered for sm_90 only: elsewhere its parameter skips."""
    from flash_tile import autotune, variants

    one_pass = ((128, variants.SM90_ONE_PASS), (256, variants.SM90_ONE_PASS_WIDE))
    if request.param == "one_pass" and torch.cuda.is_available() and \
            torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the one-pass backward is registered for sm_90 only")
    monkeypatch.setitem(variants._ONE_PASS_DEFAULTS, (9, 0),
                        one_pass if request.param == "one_pass" else ())
    monkeypatch.setattr(autotune, "decided", {})  # choices made under the real table
    return request.param
