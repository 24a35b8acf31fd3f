"""The custom ops' fake kernels and autograd wiring, without a GPU: meta tensors, on which
the ops run their registered fake kernels (``register_fake`` serves the Meta key too)."""

import inspect

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flash_tile import _ops  # registers flash_tile::attention_forward/backward

FWD = torch.ops.flash_tile.attention_forward
BWD = torch.ops.flash_tile.attention_backward


def _qkv(requires_grad=False, device="cuda"):
    q = torch.empty(2, 8, 100, 64, device=device, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 120, 64, device=device, dtype=torch.bfloat16)
    v = torch.empty(2, 2, 120, 40, device=device, dtype=torch.bfloat16)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_fake_forward_shapes_and_layout():
    q, k, v = _qkv(device="meta")
    out, lse = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
    assert out.shape == (2, 8, 100, 40) and out.dtype == torch.bfloat16
    assert out.transpose(1, 2).is_contiguous()  # memory laid out as [B, Lq, H, Dv]
    assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
    _, no_lse = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, False)
    assert no_lse.shape == (0,)


def test_fake_backward_shapes():
    q, k, v = _qkv(device="meta")
    out, lse = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
    dq, dk, dv, dsinks = BWD(out, q, k, v, out, lse, lse, None, None, 0.125, 0.0, 20, -1, 0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    assert dsinks.shape == (0,)  # no sinks: an empty gradient
    sinks = torch.zeros(q.shape[1], device="meta")
    out, lse = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True, 0.0, 0, sinks)
    *_, dsinks = BWD(out, q, k, v, out, lse, None, None, None, 0.125, 0.0, 20, -1, 0, 0.0, 0,
                     sinks)
    assert dsinks.shape == sinks.shape and dsinks.dtype == torch.float32


def _spy_on_the_ops(monkeypatch):
    """[(op name, args)] of every call of the two custom ops from here on: the module's
    ``forward_op`` / ``backward_op`` (looked up where they are called) wrapped."""
    calls = []
    for name in ("forward_op", "backward_op"):
        op = getattr(_ops, name)
        monkeypatch.setattr(_ops, name,
                            lambda *args, op=op, name=name: calls.append((name, args)) or op(*args))
    return calls


def _backward_args(loss, monkeypatch):
    """The arguments the backward op got for ``loss().backward()``, which must call it once."""
    recorded = _spy_on_the_ops(monkeypatch)
    loss().backward()
    calls = [args for name, args in recorded if name == "backward_op"]
    assert len(calls) == 1
    # The op's parameters are its body's (torch.library.custom_op infers the schema from it).
    got = inspect.signature(_ops._backward_impl).bind(*calls[0])
    got.apply_defaults()
    got = got.arguments
    return got["dout"], got["dlse"], (got["dropout_p"], got["dropout_seed"])


def test_autograd_reaches_the_backward_op(monkeypatch):
    q, k, v = _qkv(requires_grad=True, device="meta")
    out, _ = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
    dout, dlse, dropout = _backward_args(lambda: out.sum(), monkeypatch)
    assert dout.shape == out.shape and dlse is None and dropout == (0.0, 0)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("loss", ["out+lse", "lse only"])
def test_gradient_through_the_lse_reaches_the_backward_op(loss, monkeypatch):
    q, k, v = _qkv(requires_grad=True, device="meta")
    out, lse = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
    _, dlse, _ = _backward_args(lambda: lse.sum() + (out.sum() if loss == "out+lse" else 0),
                                monkeypatch)
    assert dlse is not None and dlse.shape == lse.shape
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_backward_without_lse_is_an_error():
    q, k, v = _qkv(requires_grad=True, device="meta")
    out, _ = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, False)
    with pytest.raises(RuntimeError, match="without its LSE"):
        out.sum().backward()


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("entry", ["flash_attn_func", "scaled_dot_product_attention"])
def test_public_functions_trace_without_graph_breaks(entry, requires_grad, monkeypatch):
    """torch.compile(fullgraph=True) through the public functions: validation (with the
    backward's checks when a gradient is needed), layout and the custom op in one graph. Meta
    tensors stand in for CUDA ones, so the device check (which needs a GPU) is stubbed; the
    GPU tests compile the real thing."""
    import flash_tile
    from flash_tile import api

    monkeypatch.setattr(api._validate, "check_device", lambda *tensors: tensors[0].device)
    torch.compiler.reset()
    q = torch.empty(2, 100, 4, 64, dtype=torch.float16, device="meta",
                    requires_grad=requires_grad)
    k = torch.empty(2, 120, 2, 64, dtype=torch.float16, device="meta",
                    requires_grad=requires_grad)
    if entry == "flash_attn_func":
        def fn(q, k, v):
            return flash_tile.flash_attn_func(q, k, v, causal=True, window_size=(32, -1))
    else:
        def fn(q, k, v):
            return flash_tile.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
    out = torch.compile(fn, fullgraph=True, backend="eager")(q, k, k)
    assert out.shape == q.shape


def test_dropout_arguments_reach_the_backward_op(monkeypatch):
    q, k, v = _qkv(requires_grad=True, device="meta")
    out, lse = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True, 0.1, 12345)
    assert _backward_args(lambda: out.sum(), monkeypatch)[2] == (0.1, 12345)
    q, k, v = _qkv(device="meta")
    out, lse = FWD(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True, 0.1, 12345)
    dq, dk, dv, _ = BWD(out, q, k, v, out, lse, None, None, None, 0.125, 0.0, 20, -1, 0, 0.1,
                        12345)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.fixture
def launched(monkeypatch):
    """The (grid, kernel, args) of every ``ct.launch`` that ``flash_tile._launch`` makes,
    recorded on the CPU instead of run."""
    from contextlib import nullcontext

    from flash_tile import _launch

    calls = []
    monkeypatch.setattr(_launch.ct, "launch",
                        lambda stream, grid, kernel, args, **attributes: calls.append(
                            (grid, kernel, args)))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "device", lambda device: nullcontext())
    return calls


def test_backward_launch_gives_each_kernel_its_tiles(launched):
    """``launch_backward`` with a variant whose kernels take different tiles (SM90_BACKWARD):
    dQ first on 128x64 (a program per 128 queries), storing the Delta that dK/dV on 64x128 (a
    program per 128 keys) then reads, each kernel with its own EVEN_N."""
    from flash_tile import _launch, variants

    q, k, v = (torch.randn(2, 8, 300, 64), torch.randn(2, 2, 320, 64),
               torch.randn(2, 2, 320, 64))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    out, dout, lse, dlse = torch.randn_like(q), torch.randn_like(q), *torch.randn(2, 2, 8, 300)
    config = variants.SM90_BACKWARD
    _launch.launch_backward(dout, q, k, v, out, lse, dq, dk, dv, dlse, None, None, 0.125, 0.0,
                            20, (-1, 0), config)
    (q_grid, dq_kernel, q_args), (kv_grid, dkdv, kv_args) = launched
    assert (dq_kernel, dkdv) == _launch.hinted_backward_kernels(config)
    assert q_grid == (3, 8, 2) and kv_grid == (3, 2, 2)
    # TILE_M, TILE_N, TILE_D, TILE_DV, MASK_LEFT, MASK_RIGHT, EVEN_N after 16 arrays and 8
    # scalars for dQ (14 arrays for dK/dV): 320 keys are a whole number of dQ's 64-key steps
    # and not of dK/dV's 128-key tiles. dQ's last constants are LSE_GRAD, VARLEN, SINKS and
    # SEQUSED_K; dK/dV's SEQUSED_K and DQ_ACCUM (the two-pass form: off).
    assert q_args[24:31] == (128, 64, 64, 64, False, True, True)
    assert q_args[-4:] == (True, False, False, False)
    assert kv_args[22:29] == (64, 128, 64, 64, False, True, False)
    assert kv_args[-2:] == (False, False)
    assert q_args[3:5] == (out, dout) and q_args[6] is dlse and q_args[8] is dq
    delta = q_args[7]  # written by dQ, read by dK/dV
    assert delta.shape == (2, 8, 300) and delta.dtype == torch.float32 and kv_args[5] is delta
    assert kv_args[1] is k and kv_args[6:8] == (dk, dv)


@pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])
def test_backward_past_2_31_elements_takes_the_64_bit_entry_points(launched, one_pass):
    """An output gradient of 2**31 elements (meta tensors): every kernel of either form is
    the 64-bit entry point; one element fewer keeps the 32-bit ones. Either way the launches
    match the signatures the AOT tests compile (the 64-bit ones take placeholder arrays
    where the 32-bit ones take ``ABSENT``)."""
    from flash_tile import _launch, aot, variants

    config = variants.SM90_ONE_PASS if one_pass else variants.SM90_BACKWARD
    for q_len, int64 in ((2**19, True), (2**19 - 1, False)):
        q = torch.empty(1, 32, q_len, 128, device="meta", dtype=torch.bfloat16)
        k = torch.empty(1, 8, 1024, 128, device="meta", dtype=torch.bfloat16)
        lse = torch.empty(1, 32, q_len, device="meta")
        launched.clear()
        _launch.launch_backward(q, q, k, k, q, lse, torch.empty_like(q), torch.empty_like(k),
                                torch.empty_like(k), None, None, None, 0.1, 0.0, 0, (-1, 0),
                                config)
        kernels = tuple(kernel for _, kernel, _ in launched)
        assert kernels == _launch.hinted_backward_kernels(config, int64)
        assert len(kernels) == (3 if one_pass else 2)
        sigs = aot.backward_signatures("bfloat16", 128, 128, (-1, 0), False, False, None, True,
                                       config, 4, int64_index=int64)
        for (_, _, args), sig in zip(launched, sigs, strict=True):
            _matches(args, sig)
    assert set(_launch.hinted_backward_kernels(config, True)).isdisjoint(
        _launch.hinted_backward_kernels(config, False))


@pytest.mark.parametrize("return_lse", [False, True])
def test_forward_past_2_31_elements_matches_the_64_bit_signature(launched, return_lse):
    """A q of 2**31 elements (meta tensors) launches the 64-bit forward with the arguments of
    its AOT signature, from ``launch_forward`` and from the plan made of it: without an LSE
    a placeholder array stands in for it (the entry point types Lse as 64-bit indexed, which
    an int cannot be), where the 32-bit forward gets ``ABSENT``."""
    from flash_tile import _launch, aot, variants

    config = variants.default_config((9, 0), 128)
    for q_len, int64 in ((2**19, True), (2**19 - 1, False)):
        q = torch.empty(1, 32, q_len, 128, device="meta", dtype=torch.bfloat16)
        k = torch.empty(1, 8, 1024, 128, device="meta", dtype=torch.bfloat16)
        lse = torch.empty(1, 32, q_len, device="meta") if return_lse else None
        launched.clear()
        scalars = (0.1, 0.0, 0, (-1, 0), config)
        _launch.launch_forward(q, k, k, q, lse, None, None, *scalars)
        _launch.forward_plan(q, k, k, q, lse, *scalars).launch(q, k, k, q, lse)
        sig = aot.forward_signature("bfloat16", 128, 128, (-1, 0), False, False, None, True,
                                    return_lse, config, int64_index=int64)
        for _, kernel, args in launched:
            assert kernel is _launch.hinted_kernel(config, int64)
            _matches(args, sig)
            assert isinstance(args[4], torch.Tensor) == (int64 or return_lse)


def test_one_pass_backward_launches_preprocess_dkdv_convert(launched):
    """A one-pass variant: the preprocess (Delta), dK/dV with DQ_ACCUM adding into the fp32
    dQ sums, which start as zeros, then the convert writing dq from them; the sums' rows are
    padded to 16 bytes (TMA reduce-adds need aligned strides)."""
    from flash_tile import _launch, variants

    q, k, v = (torch.randn(2, 8, 300, 72), torch.randn(2, 2, 320, 72),
               torch.randn(2, 2, 320, 72))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    out, dout, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(2, 8, 300)
    config = variants.SM90_ONE_PASS
    _launch.launch_backward(dout, q, k, v, out, lse, dq, dk, dv, None, None, None, 0.125, 0.0,
                            20, (-1, 0), config)
    (pre_grid, pre, pre_args), (kv_grid, dkdv, kv_args), (cv_grid, convert, cv_args) = launched
    assert (pre, dkdv, convert) == _launch.hinted_backward_kernels(config)
    assert pre_grid == cv_grid == (5, 8, 2) and kv_grid == (3, 2, 2)
    acc = kv_args[8]
    assert acc.dtype == torch.float32 and acc.shape == (2, 8, 300, 72)
    assert acc.stride() == (8 * 300 * 72, 300 * 72, 72, 1)  # 72 floats: 16-byte rows already
    assert not acc.any() and cv_args[0] is acc and cv_args[1] is dq
    assert not any(arg is acc for arg in pre_args)
    assert pre_args[4] is kv_args[5]  # Delta: stored by the preprocess, read by dK/dV
    assert kv_args[-1] is True  # DQ_ACCUM
    assert cv_args[3] == 0.125 and cv_args[-2:] == (False, False)  # SOFTCAP, VARLEN


def test_dq_accumulator_pads_rows_to_16_bytes():
    from flash_tile import _launch

    acc = _launch.dq_accumulator(torch.empty(1, 2, 5, 59, dtype=torch.bfloat16))
    assert acc.shape == (1, 2, 5, 59) and acc.stride() == (2 * 5 * 60, 5 * 60, 60, 1)
    assert acc.dtype == torch.float32 and not acc.any()  # the dK/dV kernel adds into zeros


def _bool_mask(layout):
    dense = torch.rand(2, 1, 40, 64) > 0.5
    return {"aligned": dense[..., :48],  # rows 64 bytes apart, 48 keys
            "broadcast": dense[..., :48].expand(2, 4, 40, 48),
            "ragged": (torch.rand(2, 4, 40, 50) > 0.5)[..., :48],  # rows 50 bytes apart
            "offset": dense[..., 1:49],  # base one byte past alignment
            "keys strided": torch.rand(2, 1, 48, 40).transpose(-1, -2) > 0.5}[layout]


@pytest.mark.parametrize("layout", ["aligned", "broadcast", "ragged", "offset", "keys strided"])
def test_bool_masks_reach_the_kernels_as_uint8_where_tma_can_read_them(launched, layout):
    """A bool mask that TMA can read (unit last stride, 16-byte aligned base and strides) is
    passed to the forward, dK/dV and dQ kernels as its uint8 view, same memory and strides
    (TMA misread bool tiles); any other stays bool (no TMA there, and uint8 would spill)."""
    from flash_tile import _launch, variants

    mask = _bool_mask(layout).expand(2, 4, 40, 48)
    q, k, v = torch.randn(2, 4, 40, 64), torch.randn(2, 4, 48, 64), torch.randn(2, 4, 48, 64)
    _launch.launch_forward(q, k, v, torch.empty_like(q), None, None, mask, 0.125, 0.0, 8,
                           (-1, -1), variants.default_config((9, 0), 64))
    _launch.launch_backward(torch.randn_like(q), q, k, v, torch.randn_like(q),
                            torch.randn(2, 4, 40), *(torch.empty_like(t) for t in (q, k, v)),
                            None, None, mask, 0.125, 0.0, 8, (-1, -1),
                            variants.default_backward_config((9, 0), 64))
    fwd, dq, dkdv = (args for _, _, args in launched)
    assert dq[-4] is False and dq[6] is _launch.ABSENT  # no dLSE: LSE_GRAD off
    as_uint8 = layout in ("aligned", "broadcast")
    for got in (fwd[6], dq[10], dkdv[10]):
        assert got.dtype == (torch.uint8 if as_uint8 else torch.bool), layout
        assert got.data_ptr() == mask.data_ptr() and got.stride() == mask.stride()
    assert fwd[-9] == _launch.BOOL_MASK  # ATTN_MASK: from the mask, whatever its view


def _stub_the_launches(monkeypatch, on_forward, on_backward):
    """The ops' bodies with sm_90's D=64 default as the chosen variant, and their
    ``launch_forward`` / ``launch_backward`` calls given to ``on_forward`` / ``on_backward``
    (the call's arguments) instead of run."""
    from flash_tile import variants

    monkeypatch.setattr(_ops, "_choose", lambda *args: variants.default_config((9, 0), 64))
    monkeypatch.setattr(_ops, "launch_forward", lambda *a, sinks=None: on_forward(a))
    monkeypatch.setattr(_ops, "launch_backward", lambda *a, sinks=None: on_backward(a))


@pytest.fixture
def op_launches(monkeypatch):
    """The arguments of every ``launch_forward`` / ``launch_backward`` call the ops' bodies
    make, recorded instead of run (``_stub_the_launches``)."""
    calls = []
    _stub_the_launches(monkeypatch, calls.append, calls.append)
    return calls


def _refuse_the_launches(monkeypatch):
    """Make any launch of the ops' bodies (as a traced call must not make) fail the test."""
    _stub_the_launches(monkeypatch, lambda args: pytest.fail("forward launched"),
                       lambda args: pytest.fail("backward launched"))


def _refuse_the_ops(monkeypatch):
    """Make any call of the two custom ops (as the eager path must not) fail the test."""
    for name in ("forward_op", "backward_op"):
        monkeypatch.setattr(_ops, name, lambda *a, name=name: pytest.fail(f"{name} called"))


@pytest.mark.parametrize("loss", ["out", "out+lse"])
def test_eager_path_runs_the_op_bodies_without_the_ops(monkeypatch, op_launches, loss):
    """In eager mode the public functions' ``attention_forward`` runs the ops' bodies through
    an autograd.Function, dispatching neither op: one forward launch, then one backward launch
    that gets the forward's output and LSE, the output's gradient, the LSE's gradient when the
    loss uses the LSE, and the forward's scalars and dropout. On CPU tensors (meta ones have
    no memory to compare), the launches recorded instead of run."""
    from flash_tile import _launch, variants

    config = variants.default_config((9, 0), 64)  # what op_launches chooses
    _refuse_the_ops(monkeypatch)
    q, k, v = _qkv(requires_grad=True, device="cpu")
    out, lse = _ops.attention_forward(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True, 0.1, 7)
    (out.sum() + (lse.sum() if loss == "out+lse" else 0)).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    (fq, fk, fv, f_out, f_lse, *f_rest), (dout, bq, bk, bv, b_out, b_lse, *b_rest) = op_launches
    assert all(x is y for x, y in zip((fq, fk, fv, f_out, f_lse, bq, bk, bv),
                                      (q, k, v, out, lse, q, k, v)))
    # The saved output and LSE come back as new tensor objects over the same memory.
    assert b_out is not out and b_out.is_set_to(out) and b_lse.is_set_to(lse)
    assert dout.shape == out.shape
    dq, dk, dv, dlse, *scalars = b_rest
    assert (dlse is None) == (loss == "out")
    dropout = _launch.Dropout(0.1, 7)
    assert f_rest == [None, None, 0.125, 0.0, 20, (-1, 0), config, dropout]
    assert scalars == [None, None, 0.125, 0.0, 20, (-1, 0), config, dropout]


@pytest.mark.parametrize("layout", ["[B, H, L, D]", "[B, L, H, D]"])
def test_gradients_reach_the_leaves_without_a_copy(monkeypatch, layout):
    """The backward writes each gradient in its leaf's layout, so autograd hands the launched
    dq, dk, dv to the leaves as they are: a gradient whose strides differ from a contiguous
    leaf's is copied into the leaf's layout, once per tensor and backward. [B, H, L, D] is the
    SDPA function's usual input; [B, L, H, D] is flash-attn's, seen by the op transposed. The
    launches are recorded by their gradients' memory addresses alone (CPU tensors, launches
    stubbed): autograd also copies a gradient that something else still references."""
    storages = []
    _stub_the_launches(monkeypatch, lambda args: None, lambda args: storages.extend(
        t.untyped_storage().data_ptr() for t in args[6:9]))  # dq, dk, dv
    leaves = _qkv(requires_grad=True, device="cpu")
    if layout == "[B, L, H, D]":
        leaves = tuple(t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves)
        q, k, v = (t.transpose(1, 2) for t in leaves)
    else:
        q, k, v = leaves
    out, _ = _ops.attention_forward(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
    out.sum().backward()
    assert [leaf.grad.untyped_storage().data_ptr() for leaf in leaves] == storages, layout


@pytest.mark.parametrize("case", ["no input needs a gradient", "torch.no_grad"])
def test_inference_builds_no_autograd_node(monkeypatch, op_launches, case):
    """Where nothing will be differentiated, ``attention_forward`` runs the op's body alone
    (no autograd.Function, no op): one forward launch, an output with no grad_fn."""
    monkeypatch.setattr(_ops._EagerAttention, "apply", lambda *a: pytest.fail("Function used"))
    _refuse_the_ops(monkeypatch)
    q, k, v = _qkv(requires_grad=case == "torch.no_grad", device="meta")
    with torch.set_grad_enabled(case != "torch.no_grad"):
        out, _ = _ops.attention_forward(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, False)
    assert len(op_launches) == 1 and out.grad_fn is None


@pytest.mark.parametrize("tracer", ["dispatch mode", "make_fx"])
def test_tracers_see_the_op(tracer, monkeypatch):
    """Under a dispatch mode (FlopCounterMode here; FakeTensorMode, ...) or make_fx the call is
    the custom op, forward and backward, as under torch.compile: the body would launch kernels
    on tensors that have no memory."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(q, k, v):
        out, lse = _ops.attention_forward(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
        return out, lse

    if tracer == "make_fx":
        graph = make_fx(fn)(*_qkv(device="meta")).graph
        assert "flash_tile.attention_forward.default" in {str(n.target) for n in graph.nodes}
        return
    _refuse_the_launches(monkeypatch)
    calls = _spy_on_the_ops(monkeypatch)
    q, k, v = _qkv(requires_grad=True, device="meta")
    with FlopCounterMode(display=False):
        out, _ = fn(q, k, v)
        out.sum().backward()
    assert [name for name, _ in calls] == ["forward_op", "backward_op"]


def test_public_functions_take_the_op_under_torch_compile():
    """While torch.compile traces, ``attention_forward`` is the custom op (its fake and its
    registered autograd are what a graph can hold)."""
    seen = []

    def fn(q, k, v):
        out, _ = _ops.attention_forward(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
        return out

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    torch.compiler.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*_qkv(device="meta"))
    assert "flash_tile.attention_forward.default" in seen, seen


def test_the_untuned_backward_default_follows_the_class(monkeypatch):
    """With tuning off, a plain D=128 class (GQA 4 here) gets sm_90's plain-class backward
    default and a class with dropout the default that holds its registers under it
    (variants._PLAIN_BACKWARD); the forward has one default for both."""
    from flash_tile import autotune, variants

    monkeypatch.setattr(_ops, "device_properties", lambda device: ((9, 0), "NVIDIA H200"))
    monkeypatch.setattr(autotune, "decided", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    q = torch.empty(1, 4, 64, 128, device="meta")
    k = v = torch.empty(1, 1, 64, 128, device="meta")

    def choose(backward, dropout_p):
        return _ops._choose(backward, q, k, v, (-1, 0), 0.0, None, None, dropout_p, None)

    assert choose(True, 0.0) == variants.SM90_BACKWARD_O2
    assert choose(True, 0.1) == variants.SM90_BACKWARD_O2_NARROW
    assert choose(False, 0.0) == choose(False, 0.1) == variants.default_config((9, 0), 128)


_TORCH_OF = {"float32": torch.float32, "int32": torch.int32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "uint8": torch.uint8, "bool": torch.bool}


def _matches(args, signature):
    """Each launch argument against the AOT signature's parameter at its place (the order the
    compiled kernels were checked in): arrays of the rank, and of the dtype unless they are an
    unused switch's placeholder (one element, never read), scalars, equal constants."""
    params = signature.parameters
    assert len(args) == len(params)
    for i, (arg, param) in enumerate(zip(args, params)):
        kind = type(param).__name__
        if kind == "ArrayConstraint":
            assert isinstance(arg, torch.Tensor) and arg.dim() == param.ndim, i
            if arg.numel() > 1:
                assert arg.dtype == _TORCH_OF[param.dtype.name], (i, arg.dtype, param.dtype)
        elif kind == "ScalarConstraint":
            assert isinstance(arg, (int, float)) and not isinstance(arg, bool), (i, arg)
        else:
            assert arg == param.value, (i, arg, param.value)


def test_varlen_sinks_launches_match_the_compiled_signatures(launched):
    """The JIT launches of the forward and both backward kernels with VARLEN, SEQUSED_K and
    SINKS pass their arguments in the order, dtypes and ranks of the signatures that the AOT
    tests compile for every architecture."""
    from flash_tile import _launch, aot, variants

    total_q, total_k = 40, 60
    q, out = torch.randn(1, 4, total_q, 64).bfloat16(), torch.randn(1, 4, total_q, 64).bfloat16()
    k, v = torch.randn(1, 2, total_k, 64).bfloat16(), torch.randn(1, 2, total_k, 64).bfloat16()
    cu_q = torch.tensor([0, 15, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 60], dtype=torch.int32)
    varlen = _launch.Varlen(cu_q, cu_k, torch.tensor([20, 33], dtype=torch.int32))
    sinks = torch.zeros(4)
    config = variants.default_config((9, 0), 64)
    _launch.launch_forward(q, k, v, out, torch.empty(1, 4, total_q), None, None, 0.125, 0.0, 0,
                           (-1, 0), config, _launch.NO_DROPOUT, varlen, sinks)
    flags = dict(varlen=True, sinks=True, seqused_k=True)
    _matches(launched[0][2], aot.forward_signature("bfloat16", 64, 64, (-1, 0), False, False,
                                                   None, False, True, config, **flags))
    for bconfig in (variants.default_backward_config((9, 0), 64), variants.SM90_ONE_PASS):
        launched.clear()
        _launch.launch_backward(out, q, k, v, out, torch.randn(1, 4, total_q),
                                *(torch.empty_like(t) for t in (q, k, v)), None, None, None,
                                0.125, 0.0, 0, (-1, 0), bconfig, _launch.NO_DROPOUT, varlen,
                                sinks)
        sigs = aot.backward_signatures("bfloat16", 64, 64, (-1, 0), False, False, None, False,
                                       bconfig, 2, **flags)
        assert len(launched) == len(sigs)
        for (_, _, args), sig in zip(launched, sigs):
            _matches(args, sig)


@pytest.mark.parametrize("page_size,splits,sinks,store_lse", [
    (None, 4, True, True), (64, 4, True, False), (None, 1, False, False), (16, 1, True, True)])
def test_decode_launches_match_the_compiled_signatures(launched, page_size, splits, sinks,
                                                       store_lse, monkeypatch):
    """The append, decode and combine launches (split or not, paged or not, with or without
    sinks and the LSE) against the signatures the AOT tests compile; every array a switch
    leaves unread goes as the int scalar ``_launch_decode.ABSENT``, which ``ct.launch`` takes
    faster than an array."""
    from flash_tile import _launch_decode, aot, variants

    monkeypatch.setattr(_launch_decode, "_sm_count", lambda device: 132)
    batch, heads, kv_heads, d = 2, 16, 2, 64
    if page_size is None:
        k_cache = torch.randn(batch, 256, kv_heads, d).bfloat16()
        table = None
    else:
        k_cache = torch.randn(512 // page_size, page_size, kv_heads, d).bfloat16()
        table = torch.randperm(512 // page_size, dtype=torch.int32).view(batch, -1)
    q = torch.randn(batch, 1, heads, d).bfloat16()
    k_new = torch.randn(batch, 1, kv_heads, d).bfloat16()
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, 1) if store_lse else None
    lens = torch.tensor([100, 200], dtype=torch.int32)
    config = variants.default_decode_config((9, 0), d)
    _launch_decode.launch_cache_append(k_new, k_new, k_cache, k_cache, lens, None, table)
    used = _launch_decode.launch_decode(q, k_cache, k_cache, out, lse, lens, None, table,
                                        None, 0.125, 0.0, (-1, 0), 1, splits, config,
                                        torch.zeros(heads) if sinks else None)
    assert (used > 1) == (splits > 1)
    sigs = aot.decode_signatures(config, head_dim=d, group=heads // kv_heads,
                                 page_size=page_size, splits=used, sinks=sinks,
                                 store_lse=store_lse)
    names = ["append", "decode"] + (["combine"] if used > 1 else [])
    assert len(launched) == len(names)
    for (_, _, args), name in zip(launched, names):
        _matches(args, sigs[name][1])
        # No placeholder array (one element) is left: every array here has more.
        assert all(arg.numel() > 1 for arg in args if isinstance(arg, torch.Tensor)), name


def test_plans_are_made_for_cuda_calls_only_and_kept_within_bounds(monkeypatch):
    """``flash_tile._plans``: CPU tensors (and meta ones) get no key, so the full path checks
    them; an unhashable argument is never found nor kept; past MAX_PLANS the plans start
    over; ``autotune.clear_memory_cache`` forgets them."""
    from flash_tile import _plans, autotune

    monkeypatch.setattr(autotune, "plans", {})
    for device in ("cpu", "meta"):
        q = torch.empty(1, 8, 2, 64, device=device)
        assert _plans.key("flash_attn", (q, q, q), (None, False)) is None
    unhashable = ("flash_attn", [8, 8])
    _plans.keep(unhashable, "plan")
    assert _plans.find(unhashable) is None and not autotune.plans
    monkeypatch.setattr(_plans, "MAX_PLANS", 2)
    for i in range(3):
        _plans.keep(("k", i), f"plan {i}")
    assert autotune.plans == {("k", 2): "plan 2"} and _plans.find(("k", 2)) == "plan 2"
    _plans.keep(None, "plan")  # no key: nothing kept
    assert _plans.find(None) is None and len(autotune.plans) == 1
    autotune.clear_memory_cache()
    assert not autotune.plans


@pytest.mark.parametrize("return_lse,window,softcap", [(False, (-1, 0), 0.0),
                                                        (True, (16, 3), 20.0)])
def test_a_planned_forward_launches_what_the_full_path_launches(launched, monkeypatch,
                                                                 return_lse, window, softcap):
    """``ForwardPlan.launch`` on a call's arrays passes ``ct.launch`` the grid, kernel and
    argument tuple that ``launch_forward`` passes for the same call (arrays by identity,
    everything else equal), on odd lengths, GQA, with and without the LSE."""
    from flash_tile import _launch, variants

    q = torch.randn(2, 8, 113, 64).transpose(1, 2).contiguous().transpose(1, 2)
    k, v = (torch.randn(2, 203, 2, 64).transpose(1, 2) for _ in range(2))
    out = torch.empty(2, 113, 8, 64).transpose(1, 2)  # [B, H, Lq, Dv] laid out as BLHD
    lse = torch.empty(2, 8, 113) if return_lse else None
    config = variants.default_config((9, 0), 64)
    scalars = (0.125, softcap, 203 - 113, window, config)
    _launch.launch_forward(q, k, v, out, lse, None, None, *scalars)
    plan = _launch.forward_plan(q, k, v, out, lse, *scalars)
    assert plan.out_shape == (2, 113, 8, 64)
    assert plan.lse_shape == ((2, 8, 113) if return_lse else None)
    q2, k2, v2, out2 = (torch.randn_like(t) for t in (q, k, v, out))  # another call's arrays
    lse2 = torch.empty_like(lse) if return_lse else None
    _launch.launch_forward(q2, k2, v2, out2, lse2, None, None, *scalars)
    plan.launch(q2, k2, v2, out2, lse2)
    (grid, kernel, args), (plan_grid, plan_kernel, plan_args) = launched[1:]
    assert plan_grid == grid and plan_kernel is kernel and len(plan_args) == len(args)
    for full, planned in zip(args, plan_args):  # the arrays by identity, the rest by value
        if isinstance(full, torch.Tensor):
            assert planned is full
        else:
            assert planned == full and type(planned) is type(full)
    lse_arg = lse2 if return_lse else args[4]  # ABSENT without an LSE
    assert all(a is b for a, b in zip(plan_args[:5], (q2, k2, v2, out2, lse_arg)))


def test_current_stream_is_made_once_per_raw_handle(monkeypatch):
    """``_launch.current_stream`` asks torch for a Stream object once per (device, raw
    handle) and hands it back while that stream stays current; another stream (or device)
    gets its own, and past MAX_STREAMS the table starts over."""
    from flash_tile import _launch

    current = {"handle": 11}
    made = []

    def make(device):
        made.append((device.index, current["handle"]))
        return object()

    monkeypatch.setattr(_launch, "_raw_stream", lambda index: current["handle"] + 100 * index)
    monkeypatch.setattr(_launch.torch.cuda, "current_stream", make)
    monkeypatch.setattr(_launch, "_streams", {})
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = _launch.current_stream(gpu0)
    assert _launch.current_stream(gpu0) is first and made == [(0, 11)]
    current["handle"] = 12  # a side stream made current
    side = _launch.current_stream(gpu0)
    assert side is not first and _launch.current_stream(gpu1) is not side
    current["handle"] = 11
    assert _launch.current_stream(gpu0) is first and made == [(0, 11), (0, 12), (1, 12)]
    monkeypatch.setattr(_launch, "MAX_STREAMS", 3)
    current["handle"] = 13
    _launch.current_stream(gpu0)
    assert len(_launch._streams) == 1  # full: started over with the new stream
    current["handle"] = 11
    assert _launch.current_stream(gpu0) is not first and made[-1] == (0, 11)
