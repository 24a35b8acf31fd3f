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


def _stub_the_launches(monkeypatch, on_forward, on_backward):
    """The ops' bodies with sm_90's D=64 default as the chosen variant, and their
    ``launch_forward`` / ``launch_backward`` calls given to ``on_forward`` / ``on_backward``
    (the call's arguments) instead of run."""
    from flash_tile import variants

    monkeypatch.setattr(_ops, "_choose",
                        lambda *args, **keywords: variants.default_config((9, 0), 64))
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


@pytest.mark.parametrize("loss", ["sum over rows", "sum over heads", "transposed"])
def test_the_backward_reads_a_dense_output_gradient(monkeypatch, op_launches, loss):
    """A loss's gradient may reach the backward broadcast (autograd's gradient of a sum is an
    expand: stride 0) or with a strided last dim: the kernels get a copy without either,
    holding the same values. CPU tensors, the launches recorded."""
    q, k, v = _qkv(requires_grad=True, device="cpu")
    out, _ = _ops.attention_forward(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
    if loss == "sum over rows":  # the sum's gradient is the expand, as out's dtype
        out.sum(2).float().square().sum().backward()
    elif loss == "sum over heads":
        (out.sum(1).float() * torch.arange(40.0)).sum().backward()
    else:
        out.backward(torch.randn(2, 8, 40, 100, dtype=out.dtype).transpose(-1, -2))
    dout = op_launches[-1][0]
    assert dout.stride(-1) == 1 and all(st > 0 for st in dout.stride()), dout.stride()
    assert dout.shape == out.shape


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_a_second_backward_raises_instead_of_dropping_terms(monkeypatch, op_launches, varlen):
    """With create_graph=True eager mode's backward takes the backward op, which has no
    backward: differentiating the gradients raises, as under torch.compile. Its body would
    return tensors without a graph, so a loss of the gradients (a gradient penalty) would
    miss its second-order terms silently. On meta tensors (the backward op's fake answers
    the first backward), the forward's launch recorded."""
    q, k, v = _qkv(requires_grad=True, device="meta")
    if varlen:
        q, k, v = (t.detach()[:1].transpose(1, 2).flatten(0, 1).requires_grad_()
                   for t in (q, k, v))
        cu_q = torch.tensor([0, 40, 100], dtype=torch.int32, device="meta")
        cu_k = torch.tensor([0, 50, 120], dtype=torch.int32, device="meta")
        out, _ = _ops.varlen_attention(q, k, v, cu_q, cu_k, None, 0.125, 0.0, -1, 0, True)
    else:
        out, _ = _ops.attention_forward(q, k, v, None, None, 0.125, 0.0, 20, -1, 0, True)
    dq, = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="autograd"):
        (dq.float() * q.float()).sum().backward()


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


@pytest.mark.parametrize("entry", ["flash_attn_func", "flash_attn_kvpacked_func",
                                   "flash_attn_varlen_func"])
def test_return_attn_probs_gives_flash_attn_2s_triple(monkeypatch, op_launches, entry):
    """``return_attn_probs=True`` without dropout returns flash-attn 2's (out, softmax_lse,
    S_dmask): the LSE the forward launch stores (dense [B, H, Lq], varlen [H, total_q]) and an
    empty S_dmask of q's dtype, as flash-attn's without dropout. CPU tensors, the launches
    recorded instead of run."""
    import flash_tile
    from flash_tile import _validate

    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    q, k = torch.randn(2, 17, 4, 64).bfloat16(), torch.randn(2, 30, 2, 64).bfloat16()
    if entry == "flash_attn_func":
        out, lse, s_dmask = flash_tile.flash_attn_func(q, k, k, causal=True,
                                                       return_attn_probs=True)
        lse_shape = (2, 4, 17)
    elif entry == "flash_attn_kvpacked_func":
        out, lse, s_dmask = flash_tile.flash_attn_kvpacked_func(
            q, torch.stack([k, k], 2), 0.0, None, True, (-1, -1), 0.0, None, False, True)
        lse_shape = (2, 4, 17)
    else:
        cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (17, 30))
        out, lse, s_dmask = flash_tile.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1), cu_q, cu_k, 17, 30,
            causal=True, return_attn_probs=True)
        lse_shape = (4, 34)
    assert out.shape[-2:] == (4, 64) and out.dtype == q.dtype
    assert lse.shape == lse_shape and lse.dtype == torch.float32
    assert s_dmask.numel() == 0 and s_dmask.dtype == q.dtype
    (launch,) = op_launches
    assert launch[4].data_ptr() == lse.data_ptr()  # the LSE the kernel stores


@pytest.mark.parametrize("entry", ["flash_attn_func", "sdpa", "sdpa, no batch"])
def test_no_query_rows_give_empty_outputs_and_zero_gradients(monkeypatch, op_launches, entry):
    """Lq = 0 (or a batch of 0), legal in torch's SDPA: empty outputs of the right shapes, and
    a backward that launches nothing and gives k and v zero gradients. CPU tensors, the
    launches recorded instead of run (the forward's grid of no programs is ``launch_on``'s
    to skip: ``test_launch.py``)."""
    import flash_tile
    from flash_tile import _validate

    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    if entry == "flash_attn_func":
        q, k = torch.randn(2, 0, 4, 64), torch.randn(2, 5, 2, 64)
    else:
        batch = (0, 3) if entry == "sdpa, no batch" else (2,)
        q, k = torch.randn(*batch, 4, 0, 64), torch.randn(*batch, 2, 5, 64)
    q, k = (t.bfloat16().requires_grad_() for t in (q, k))
    v = k.detach().clone().requires_grad_()
    if entry == "flash_attn_func":
        out = flash_tile.flash_attn_func(q, k, v, causal=True)
    else:
        out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == q.shape and out.numel() == 0
    out.sum().backward()
    assert len(op_launches) == 1  # the forward's, with no programs; no backward launch
    assert q.grad.shape == q.shape
    assert bool((k.grad == 0).all()) and bool((v.grad == 0).all())


@pytest.mark.parametrize("sinks", [False, True])
def test_no_keys_give_rows_that_see_none(monkeypatch, op_launches, sinks):
    """Lk = 0 (torch's SDPA returns zeros, flash-attn zeros and an LSE of +inf): out 0, the
    LSE +inf or the row's sink, nothing launched; the backward gives dq 0 and, with sinks,
    dsinks[h] = the sum of head h's dLSE (the sink is each row's one term). CPU tensors."""
    import flash_tile
    from flash_tile import _validate

    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    q = torch.randn(2, 17, 4, 64).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 0, 2, 64).bfloat16().requires_grad_() for _ in range(2))
    logits = torch.randn(4).requires_grad_() if sinks else None
    out, lse = flash_tile.flash_attn_func(q, k, v, causal=True, return_lse=True, sinks=logits)
    assert bool((out == 0).all()) and out.shape == (2, 17, 4, 64)
    want = logits.detach()[None, :, None].expand(2, 4, 17) if sinks else torch.full(
        (2, 4, 17), torch.inf)
    assert torch.equal(lse.detach(), want)
    dlse = torch.randn(2, 4, 17)
    torch.autograd.backward((out, lse), (torch.randn_like(out), dlse))
    assert not op_launches  # neither the forward nor the backward launched
    assert bool((q.grad == 0).all()) and k.grad.shape == k.shape
    if sinks:
        torch.testing.assert_close(logits.grad, dlse.sum((0, 2)))
    sdpa = flash_tile.scaled_dot_product_attention(q.detach().transpose(1, 2),
                                                   k.detach().transpose(1, 2),
                                                   v.detach().transpose(1, 2), enable_gqa=True)
    assert torch.equal(sdpa, torch.nn.functional.scaled_dot_product_attention(
        q.detach().transpose(1, 2).float(), k.detach().transpose(1, 2).float(),
        v.detach().transpose(1, 2).float(), enable_gqa=True).bfloat16())
