"""The launchers, without a GPU: every `ct.launch` that `flash_tile._launch` and
`flash_tile._launch_decode` make is recorded on the CPU instead of run, and its arguments are
checked against the AOT signatures the compiled kernels were checked in; the call plans and the
stream table."""

import dataclasses

import pytest
import torch

from conftest import array_interface


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
    from flash_tile import _launch, _plans, aot, variants

    config = variants.default_config((9, 0), 128)
    for q_len, int64 in ((2**19, True), (2**19 - 1, False)):
        q = torch.empty(1, 32, q_len, 128, device="meta", dtype=torch.bfloat16)
        k = torch.empty(1, 8, 1024, 128, device="meta", dtype=torch.bfloat16)
        lse = torch.empty(1, 32, q_len, device="meta") if return_lse else None
        launched.clear()
        scalars = (0.1, 0.0, 0, (-1, 0), config)
        _launch.launch_forward(q, k, k, q, lse, None, None, *scalars)
        _plans.forward_plan(q, k, k, q, lse, *scalars).launch(q, k, k, q, lse)
        sig = aot.forward_signature("bfloat16", 128, 128, (-1, 0), False, False, None, True,
                                    return_lse, config, int64_index=int64)
        for _, kernel, args in launched:
            assert kernel is _launch.hinted_kernel(config, int64)
            _matches(args, sig)
            assert (not isinstance(args[4], int)) == (int64 or return_lse)


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
    # The forward's constants end its arguments, in ForwardSpec's field order.
    names = [field.name for field in dataclasses.fields(_launch.ForwardSpec)]
    constants = dict(zip(names, fwd[-len(names):]))
    assert constants["attn_mask"] == _launch.BOOL_MASK  # from the mask, whatever its view


_TORCH_OF = {"float32": torch.float32, "int32": torch.int32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "uint8": torch.uint8, "bool": torch.bool,
             "float8_e4m3fn": torch.float8_e4m3fn}


def _matches(args, signature):
    """Each launch argument against the AOT signature's parameter at its place (the order the
    compiled kernels were checked in): arrays (tensors, or a plan's by address) of the rank,
    and of the dtype unless they are an unused switch's placeholder (one element, never
    read), scalars, equal constants."""
    from flash_tile import _arrays

    params = signature.parameters
    assert len(args) == len(params)
    for i, (arg, param) in enumerate(zip(args, params)):
        kind = type(param).__name__
        if kind == "ArrayConstraint":
            dtype = _TORCH_OF[param.dtype.name]
            if isinstance(arg, _arrays.Array):
                face = arg.__cuda_array_interface__
                assert len(face["shape"]) == param.ndim, i
                assert face["typestr"] == _arrays.TYPESTRS[dtype], (i, face, param.dtype)
                continue
            assert isinstance(arg, torch.Tensor) and arg.dim() == param.ndim, i
            if arg.numel() > 1:
                assert arg.dtype == dtype, (i, arg.dtype, param.dtype)
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


@pytest.mark.parametrize("page_size,seqused_k,kv_dtype", [
    (16, False, None), (1, True, None), (64, True, "float8_e4m3fn"), (3, False, "float8_e4m3fn")])
def test_paged_varlen_launches_match_the_compiled_signature(launched, page_size, seqused_k,
                                                            kv_dtype):
    """The JIT launch of the forward's PAGED switch (pages loaded as tiles or gathered by
    row; FA3's seqused_k form without cu_seqlens_k; bfloat16 pages or an FP8 cache with its
    k and v descale arrays) passes its arguments in the order, dtypes and ranks of the signature the
    AOT tests compile."""
    from flash_tile import _launch, aot, variants

    q, out = torch.randn(1, 4, 40, 64).bfloat16(), torch.randn(1, 4, 40, 64).bfloat16()
    k, v = (torch.randn(9, page_size, 2, 64).to(getattr(torch, kv_dtype or "bfloat16"))
            for _ in range(2))
    cu_q = torch.tensor([0, 15, 40], dtype=torch.int32)
    used = torch.tensor([20, 33], dtype=torch.int32)
    table = torch.zeros(2, 5, dtype=torch.int32)
    varlen = _launch.Varlen(cu_q, None if seqused_k else torch.tensor([0, 20, 53]).int(),
                            used if seqused_k else None, table)
    descales = (None, torch.rand(2, 2), torch.rand(2, 2)) if kv_dtype else None
    config = variants.paged_config((9, 0), 64)
    _launch.launch_forward(q, k, v, out, torch.empty(1, 4, 40), None, None, 0.125, 0.0, 0,
                           (-1, 0), config, _launch.NO_DROPOUT, varlen, None, descales)
    _matches(launched[0][2], aot.forward_signature(
        "bfloat16", 64, 64, (-1, 0), False, False, None, False, True, config, varlen=True,
        seqused_k=seqused_k, page_size=page_size, kv_dtype=kv_dtype))


@pytest.mark.parametrize("page_size,splits,sinks,store_lse", [
    (None, 4, True, True), (64, 4, True, False), (None, 1, False, False), (16, 1, True, True)])
def test_decode_launches_match_the_compiled_signatures(launched, page_size, splits, sinks,
                                                       store_lse, monkeypatch):
    """The append, decode and combine launches (split or not, paged or not, with or without
    sinks and the LSE) against the signatures the AOT tests compile; every array a switch
    leaves unread goes as the int scalar ``_launch_decode.ABSENT``, which ``ct.launch`` takes
    faster than an array."""
    from flash_tile import _launch_decode, aot, decode_variants

    monkeypatch.setattr(_launch_decode, "_sm_count", lambda device: 132)
    workspaces = []
    allocate = _launch_decode.decode_workspace
    monkeypatch.setattr(_launch_decode, "decode_workspace",
                        lambda *args: workspaces.append(allocate(*args)) or workspaces[-1])
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
    config = decode_variants.default_decode_config((9, 0), d)
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
    if used > 1:  # the partials: one workspace, the LSEs past the outputs, 256-byte aligned
        (workspace,) = workspaces
        group, partials = heads // kv_heads, used * batch * heads * d
        offset = -(-partials // 64) * 64  # fp32 elements of 256 bytes
        assert workspace.numel() == offset + used * batch * heads
        outs, lses = workspace[:partials], workspace[offset:]
        decode_args, combine_args = launched[1][2], launched[2][2]
        expected = {
            "decode": (outs.view(used, batch, 1, kv_heads, group, d),
                       lses.view(used, batch, 1, kv_heads, group)),
            "combine": (outs.view(used, batch, 1, heads, d), lses.view(used, batch, 1, heads))}
        passed = {"decode": decode_args[5:7], "combine": combine_args[:2]}
        for name, arrays in expected.items():
            assert [a.__cuda_array_interface__ for a in passed[name]] == \
                [array_interface(t) for t in arrays], name
    else:
        assert not workspaces


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


@pytest.mark.parametrize("return_lse,window,softcap,dtype", [
    (False, (-1, 0), 0.0, torch.bfloat16), (True, (16, 3), 20.0, torch.float16)])
def test_a_planned_forward_launches_what_the_full_path_launches(launched, monkeypatch,
                                                                 return_lse, window, softcap,
                                                                 dtype):
    """``ForwardPlan.launch`` on a call's arrays passes ``ct.launch`` the grid, kernel and
    argument tuple that ``launch_forward`` passes for the same call: each array by its CUDA
    Array Interface, the layout of the tensor the full path passes at that tensor's address,
    whether the plan is handed the [B, H, L, D] views or the [B, L, H, D] tensors under them;
    everything else equal; the outputs it allocates are laid out as the plan says. Odd
    lengths, GQA, with and without the LSE."""
    from flash_tile import _launch, _plans, variants

    def bhld(*shape):  # a [B, H, L, D] view of a fresh [B, L, H, D] tensor
        return torch.randn(*shape, dtype=dtype).transpose(1, 2)

    q = bhld(2, 113, 8, 64)
    k, v = bhld(2, 203, 2, 64), bhld(2, 203, 2, 64)
    out = torch.empty(2, 113, 8, 64, dtype=dtype).transpose(1, 2)
    lse = torch.empty(2, 8, 113) if return_lse else None
    config = variants.default_config((9, 0), 64)
    scalars = (0.125, softcap, 203 - 113, window, config)
    _launch.launch_forward(q, k, v, out, lse, None, None, *scalars)
    plan = _plans.forward_plan(q, k, v, out, lse, *scalars)
    blhd = torch.empty(2, 113, 8, 64)
    assert plan.out == (blhd.shape, blhd.stride()) and plan.dtype == dtype
    assert plan.out_bhld == (blhd.transpose(1, 2).shape, blhd.transpose(1, 2).stride())
    assert plan.lse == (((2, 8, 113), (8 * 113, 113, 1)) if return_lse else None)
    fresh, fresh_lse = _plans.outputs(plan)  # what a planned call allocates
    assert fresh.shape == (2, 113, 8, 64) and fresh.is_contiguous() and fresh.dtype == dtype
    view = _plans.outputs(plan, bhld=True)[0]  # SDPA's layout, the same memory order
    assert view.shape == (2, 8, 113, 64) and view.transpose(1, 2).is_contiguous()
    assert fresh_lse.is_contiguous() and fresh_lse.shape == (2, 8, 113) if return_lse else \
        fresh_lse is None
    q2, k2, v2, out2 = (bhld(*t.transpose(1, 2).shape) for t in (q, k, v, out))
    lse2 = torch.empty_like(lse) if return_lse else None
    _launch.launch_forward(q2, k2, v2, out2, lse2, None, None, *scalars)
    plan.launch(q2, k2, v2, out2, lse2)
    plan.launch(*(t.transpose(1, 2) for t in (q2, k2, v2, out2)), lse2)
    (grid, kernel, args), *planned = launched[1:]
    for plan_grid, plan_kernel, plan_args in planned:
        assert plan_grid == grid and plan_kernel is kernel and len(plan_args) == len(args)
        for full, passed in zip(args, plan_args):
            if isinstance(full, torch.Tensor):
                assert passed.__cuda_array_interface__ == array_interface(full)
            else:
                assert passed == full and type(passed) is type(full)
    assert return_lse == isinstance(args[4], torch.Tensor)  # ABSENT without an LSE


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


def test_a_grid_of_no_programs_launches_nothing(monkeypatch):
    """``launch_on`` skips a grid with a zero dimension (a call with no query rows): CUDA
    refuses an empty grid, and there is nothing to run."""
    from flash_tile import _launch

    launches = []
    monkeypatch.setattr(_launch.ct, "launch", lambda *args, **attributes: launches.append(args))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "current_device", lambda: 0)
    device = torch.device("cuda", 0)
    _launch.launch_on(device, (0, 4, 2), None, ())
    _launch.launch_on(device, (3, 4, 0), None, ())
    assert not launches
    _launch.launch_on(device, (1, 1, 1), None, ())
    assert len(launches) == 1


def test_a_planned_forward_without_keys_launches_nothing_and_keeps_no_plan(launched):
    """``_plans.forward`` on Lk = 0 answers through the op's body (out 0, LSE +inf) and makes
    no plan: a plan would launch a kernel over no keys. CPU tensors, launches recorded."""
    from flash_tile import _plans

    q, k = torch.randn(2, 4, 17, 64).bfloat16(), torch.randn(2, 2, 0, 64).bfloat16()
    out, lse, plan = _plans.forward(q, k, k, 0.125, 0.0, -17, -1, 0, True)
    assert plan is None and not launched
    assert out.shape == (2, 17, 4, 64) and bool((out == 0).all())
    assert lse.shape == (2, 4, 17) and bool((lse == torch.inf).all())


def test_cupy_arguments_are_looked_for_once_cupy_is_imported(monkeypatch):
    """``accepts_cupy`` passes a call straight on while CuPy is not imported (no argument can
    be a CuPy array then) and converts a CuPy-typed argument once it is (here the conversion
    is stopped at its first step, ``torch.from_dlpack``)."""
    import sys

    from flash_tile import _interop

    array = type("ndarray", (), {"__module__": "cupy._core.core"})()
    calls = []
    wrapped = _interop.accepts_cupy(lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    wrapped(array, scale=array)
    assert calls == [((array,), {"scale": array})]

    class Converted(Exception):
        pass

    def from_dlpack(a):
        raise Converted

    monkeypatch.setitem(sys.modules, "cupy", type(sys)("cupy"))
    monkeypatch.setattr(_interop.torch, "from_dlpack", from_dlpack)
    with pytest.raises(Converted):
        wrapped(array)
    wrapped(torch.zeros(1), 2.0, None)  # plain arguments: passed on as they are
    assert len(calls) == 2


def _stub_a_gpu_call(monkeypatch):
    """A public call on CPU tensors as on CUDA ones, from no plans: the device checks, the
    device's properties (sm_90) and the variant choice (sm_90's D = 64 default, final)
    stubbed."""
    from flash_tile import _ops, _ops_paged, _validate, autotune, variants

    monkeypatch.setattr(autotune, "plans", {})
    monkeypatch.setattr(autotune, "sighted", set())
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_ops, "_choose_final",
                        lambda *args, **kw: (variants.default_config((9, 0), 64), True))
    monkeypatch.setattr(_ops, "choice_is_final", lambda q, k: True)
    monkeypatch.setattr(_ops_paged, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(_validate, "device_properties", lambda device: ((9, 0), "H200"))


@pytest.mark.parametrize("entry", ["flash_attn_func", "qkvpacked", "sdpa"])
def test_a_seen_signature_launches_its_first_calls_arguments(launched, monkeypatch, entry):
    """A public call of a seen signature takes its plan (the full path's checks fail once the
    plan exists) and launches the first call's grid, kernel and scalars with each array at
    the new call's addresses (q, k, v as given: packed views, GQA, odd lengths) in the first
    call's layouts; the out (and LSE) it returns are the arrays the kernel writes. CPU
    tensors stand for CUDA ones: the device checks and the variant choice are stubbed."""
    import flash_tile
    from flash_tile import _validate, autotune

    _stub_a_gpu_call(monkeypatch)

    def call():  # fresh inputs of one signature; (q, k, v as launched, out, lse)
        if entry == "qkvpacked":
            qkv = torch.randn(2, 113, 3, 4, 64, dtype=torch.bfloat16)
            out, lse = flash_tile.flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True)
            return qkv.unbind(2), out, lse
        if entry == "sdpa":
            q, k, v = (torch.randn(2, n, 4, 64, dtype=torch.float16).transpose(1, 2)
                       for n in (17, 203, 203))
            return (q, k, v), flash_tile.scaled_dot_product_attention(q, k, v), None
        q = torch.randn(1, 113, 8, 64, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 203, 2, 64, dtype=torch.bfloat16) for _ in range(2))
        out, lse = flash_tile.flash_attn_func(q, k, v, window_size=(16, 3), return_lse=True)
        return (q, k, v), out, lse

    first = call()
    assert len(autotune.plans) == 1

    def fail(*args, **kwargs):
        pytest.fail("the full path ran where a plan should have")
    monkeypatch.setattr(_validate, "check_dtypes", fail)
    (q, k, v), out, lse = call()
    assert len(autotune.plans) == 1 and len(launched) == 2
    (grid, kernel, args), (plan_grid, plan_kernel, plan_args) = launched
    assert plan_grid == grid and plan_kernel is kernel and len(plan_args) == len(args)
    addresses = [t.data_ptr() for t in (q, k, v, out)] + [None if lse is None else lse.data_ptr()]
    for i, (before, now) in enumerate(zip(args, plan_args)):
        if i < 5 and addresses[i] is not None:
            face, face_before = now.__cuda_array_interface__, before.__cuda_array_interface__
            assert face["data"] == (addresses[i], False)
            assert {**face, "data": None} == {**face_before, "data": None}, i
        else:
            assert now == before and type(now) is type(before), i
    assert first[1].shape == out.shape and first[1].stride() == out.stride()


#: An FP8 cache's descale factors as a planned paged call may pass them (B 3, H_kv 2), and
#: the (shape, byte strides) of the [B, H_kv] views the kernel reads them through.
FP8_CACHE_FACTORS = {
    "paged_fp8": (lambda: {"k_descale": torch.rand(3, 2) + 0.5, "v_descale": torch.tensor(0.7)},
                  (((3, 2), (8, 4)), ((3, 2), (0, 0)))),
    "paged_fp8_transposed_and_none": (lambda: {"k_descale": (torch.rand(2, 3) + 0.5).t()},
                                      (((3, 2), (4, 12)), ((3, 2), (0, 0)))),
    "paged_fp8_one_element": (lambda: {"k_descale": torch.full((1,), 0.6),
                                       "v_descale": torch.full((1, 1), 0.8)},
                              (((3, 2), (0, 0)), ((3, 2), (0, 0)))),
}


@pytest.mark.parametrize("entry", ["varlen", "seqused_k", "paged", "paged_fa3",
                                   *FP8_CACHE_FACTORS])
def test_a_seen_varlen_signature_launches_its_first_calls_arguments(launched, monkeypatch,
                                                                    entry):
    """A packed (or paged) inference call of a seen signature takes its plan (the full path's
    checks fail once the plan exists) and launches the first call's grid, kernel and scalars
    with q, k, v, the outputs and the sequences' arrays (cu_seqlens_q/k, seqused_k, the block
    table) at the new call's addresses in the first call's layouts, an FP8 cache's pages as
    the call's tensors and its descales at the addresses of the call's factor tensors (the
    kept 1 for None) in the layouts of the first call's [B, H_kv] views (zero strides for one
    factor, a transposed factor's strides as given); the out and
    LSE it returns are what the kernel writes, packed as the full path's. CPU tensors stand
    for CUDA ones: the device checks and the variant choice are stubbed."""
    import flash_tile
    from flash_tile import _launch, _validate, autotune

    _stub_a_gpu_call(monkeypatch)
    paged = entry.startswith("paged")
    fp8 = entry in FP8_CACHE_FACTORS

    def call():  # fresh inputs of one signature: (arrays in launch order, out, lse)
        q = torch.randn(40, 8, 64, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, 17, 17, 40], dtype=torch.int32)
        cu_k = torch.tensor([0, 30, 31, 80], dtype=torch.int32)
        used = torch.tensor([25, 0, 49], dtype=torch.int32)
        table = torch.randperm(12).to(torch.int32).reshape(3, 4)
        if paged:
            k, v = (torch.randn(12, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
        else:
            k, v = (torch.randn(80, 2, 64, dtype=torch.bfloat16) for _ in range(2))
        scales = {}
        if fp8:
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            scales = FP8_CACHE_FACTORS[entry][0]()
        fa3 = entry in ("seqused_k", "paged_fa3")
        out, lse = flash_tile.flash_attn_varlen_func(
            q, k, v, cu_q, None if entry == "paged_fa3" else cu_k, 23, 49, causal=True,
            window_size=(16, -1), return_lse=True, seqused_k=used if fa3 else None,
            block_table=table if paged else None, **scales)
        sequences = [cu_q, None if entry == "paged_fa3" else cu_k, used if fa3 else None,
                     table if paged else None]
        return (q, k, v, out, lse), dict(zip(_launch.SEQUENCE_SLOTS, sequences)), out, lse, \
            scales

    call()  # a signature's first sighting: the full path, no plan (its key is recorded)
    assert not autotune.plans and len(autotune.sighted) == 1
    first = call()  # the second: a plan
    assert len(autotune.plans) == 1

    def fail(*args, **kwargs):
        pytest.fail("the full path ran where a plan should have")
    monkeypatch.setattr(_validate, "check_dtypes", fail)
    arrays, sequences, out, lse, scales = call()
    assert len(autotune.plans) == 1 and len(launched) == 3
    (grid, kernel, args), (plan_grid, plan_kernel, plan_args) = launched[1:]
    assert plan_grid == grid and plan_kernel is kernel and len(plan_args) == len(args)
    addresses = {i: t.data_ptr() for i, t in enumerate(arrays)}
    addresses.update({i: t.data_ptr() for i, t in sequences.items() if t is not None})
    if fp8:  # the pages as the call's tensors, the descales where the call's factors are
        assert plan_args[1] is arrays[1] and plan_args[2] is arrays[2]
        addresses[1] = addresses[2] = None
        one = _validate.one_factor(torch.device("cpu"))
        for slot, name, view in zip(_launch.CACHE_DESCALE_SLOTS, ("k_descale", "v_descale"),
                                    FP8_CACHE_FACTORS[entry][1]):
            addresses[slot] = scales.get(name, one).data_ptr()
            face = plan_args[slot].__cuda_array_interface__
            assert (face["shape"], face["strides"]) == view, name
    for i, (before, now) in enumerate(zip(args, plan_args)):
        if i in addresses and addresses[i] is None:
            continue
        if i in addresses:
            face, face_before = now.__cuda_array_interface__, before.__cuda_array_interface__
            assert face["data"] == (addresses[i], False), i
            assert {**face, "data": None} == {**face_before, "data": None}, i
        else:
            assert now == before and type(now) is type(before), i
    assert (out.shape, out.stride(), lse.shape) == (first[2].shape, first[2].stride(),
                                                     first[3].shape)
    # Another signature's call (the same arrays without the LSE) is not served by the plan:
    # it takes the full path, whose checks now fail.
    cu_q, cu_k, used, table = sequences.values()
    with pytest.raises(pytest.fail.Exception, match="full path"):
        flash_tile.flash_attn_varlen_func(*arrays[:3], cu_q, cu_k, 23, 49, causal=True,
                                          window_size=(16, -1), seqused_k=used,
                                          block_table=table, **scales)


@pytest.mark.parametrize("paged,fp8", [(False, False), (True, False), (True, True)])
def test_a_planned_varlen_call_launches_what_the_full_path_launches(launched, monkeypatch,
                                                                    paged, fp8):
    """The first call of a varlen signature runs ``_plans.varlen``, not the op: it must pass
    ``ct.launch`` the grid, kernel and arguments the op's body passes for the same call
    (each array by its CUDA Array Interface at that tensor's address, an FP8 cache's pages
    as the tensors; the same variant: the tuner's choice, or the paged tile), and return the
    outputs the op returns, packed."""
    from flash_tile import _launch, _ops, _ops_paged, _plans

    _stub_a_gpu_call(monkeypatch)
    q = torch.randn(40, 8, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 17, 17, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 31, 80], dtype=torch.int32)
    table = torch.randperm(12).to(torch.int32).reshape(3, 4) if paged else None
    shape = (12, 16, 2, 64) if paged else (80, 2, 64)
    k, v = (torch.randn(*shape, dtype=torch.bfloat16) for _ in range(2))
    kv_descale = None
    if fp8:  # an FP8 cache: e4m3 pages, [B, H_kv] factors (one for v, a stride-0 view)
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        kv_descale = (torch.rand(3, 2) + 0.5, torch.tensor(0.7).expand(3, 2))
    sequences = _launch.Varlen(cu_q, cu_k, None, table)
    window = (16, 0)
    if paged:
        full = _ops_paged._paged_varlen_impl(q, k, v, table, cu_q, cu_k, None, None, 0.125,
                                             0.0, *window, True, None,
                                             *(kv_descale or (None, None)))
    else:
        full = _ops._varlen_forward_impl(q, k, v, cu_q, cu_k, None, 0.125, 0.0, *window, True)
    config = _ops_paged.paged_tile(q, v) if paged else None
    out, lse, plan = _plans.varlen(q, k, v, sequences, 0.125, 0.0, window, True, config,
                                   kv_descale)
    assert plan is not None and (out.shape, lse.shape) == (full[0].shape, full[1].shape)
    (grid, kernel, args), (plan_grid, plan_kernel, plan_args) = launched
    assert plan_grid == grid and plan_kernel is kernel and len(plan_args) == len(args)
    outputs = {3: out, 4: lse}  # each side's own outputs, in the layouts the kernel reads
    for i, (before, passed) in enumerate(zip(args, plan_args)):
        if isinstance(before, torch.Tensor) and before.dtype == torch.float8_e4m3fn:
            assert passed is before, i  # e4m3 has no type string: the tensor itself
        elif isinstance(before, torch.Tensor):
            face = array_interface(before)
            if i in outputs:  # the plan's own outputs, laid out as the full path's
                view = outputs[i].transpose(0, 1)[None] if i == 3 else outputs[i][None]
                assert {**array_interface(view), "data": None} == {**face, "data": None}, i
                face = array_interface(view)
            assert passed.__cuda_array_interface__ == face, i
        else:
            assert passed == before and type(passed) is type(before), i
