"""The KV-cache call's launches on the CPU: flash_attn_with_kvcache's arguments as they reach
the append and the decode (recorded instead of run), the planned step's hand-offs, and the
32/64-bit choices of big caches."""

import pytest
import torch

import flash_tile
from conftest import array_interface
from flash_tile import _launch, _launch_decode, _plans, _validate, decode_variants


def _q(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def test_the_call_reaches_the_launches_with_its_arguments(monkeypatch):
    """The wiring from flash_attn_with_kvcache to the two launches, on CPU tensors with the
    launches recorded instead of run: the append first, at cache_seqlens, then the decode with
    the new rows counted, the causal window, the LSE buffer and the split request."""
    from flash_tile import _ops_decode

    calls = []
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_ops_decode, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(_ops_decode, "launch_cache_append", lambda *a: calls.append(("append", a)))
    monkeypatch.setattr(_ops_decode, "launch_decode", lambda *a: calls.append(("decode", a)))
    q = _q(2, 3, 8, 64)
    k_cache, v_cache = _q(4, 100, 2, 64), _q(4, 100, 2, 32)
    k_new, v_new = _q(2, 3, 2, 64), _q(2, 3, 2, 32)
    lens = torch.tensor([5, 90], dtype=torch.int32)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    out, lse = flash_tile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, cache_batch_idx=idx,
        causal=True, window_size=(50, -1), softcap=10.0, num_splits=3,
        return_softmax_lse=True)
    assert [name for name, _ in calls] == ["append", "decode"]
    append, decode = calls[0][1], calls[1][1]
    assert append[0] is k_new and append[2] is k_cache and append[4] is lens
    assert append[5] is idx and append[6] is None
    (dq, dk, dv, dout, dlse, dlens, didx, dtable, dslopes, scale, softcap, window, new_len,
     splits, config, dsinks, dpads, ddescale, dmask) = decode
    assert dq is q and dk is k_cache and dv is v_cache and dout is out and dlse is lse
    assert dlens is lens and didx is idx and dtable is None and dslopes is None
    assert dsinks is None and ddescale is None and dmask is None
    assert (scale, softcap, window, new_len, splits) == (0.125, 10.0, (50, 0), 3, 3)
    assert config == decode_variants.default_decode_config((9, 0), 64)
    assert out.shape == (2, 3, 8, 32) and lse.shape == (2, 8, 3)
    # no rotary, no pad, the 64-bit choice left to the append
    assert append[7:] == (q, None, None, None, None) and dpads is None
    calls.clear()
    flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7)  # an int length
    assert [name for name, _ in calls] == ["decode"]
    assert calls[0][1][5].tolist() == [7, 7] and calls[0][1][4] is None  # no LSE asked
    calls.clear()  # a mask over the capacity reaches the decode as [B, 1, Lq, L]
    mask = torch.rand(100) > 0.5
    flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, attn_mask=mask)
    dmask = calls[0][1][-1]
    assert dmask.shape == (2, 1, 3, 100) and torch.equal(dmask[1, 0, 2], mask)

    # An FP8 cache: the descale factors reach both launches as [B, H_kv] views (one factor
    # per tensor expanded, none given as 1), new bf16 rows go to the append to be quantized.
    monkeypatch.setattr(_validate, "device_properties", lambda device: ((9, 0), "H200"))
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    calls.clear()
    flash_tile.flash_attn_with_kvcache(q, k8, v8, k_new, v_new, cache_seqlens=lens,
                                       k_descale=torch.tensor(0.5))
    (_, append), (_, decode) = calls
    assert append[2] is k8 and append[-2] is decode[-2] and append[-1] is None
    kd, vd = decode[-2]
    assert kd.shape == vd.shape == (2, 2) and kd.eq(0.5).all() and vd.eq(1.0).all()
    monkeypatch.setattr(_validate, "device_properties", lambda device: ((8, 9), "L40S"))
    with pytest.raises(RuntimeError, match="9.0 or newer"):
        flash_tile.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens)

    # q and new rows with a strided last dim are copied, as flash-attn's wrapper does (the
    # caches are written in place: theirs must be unit-stride); no batch raises.
    calls.clear()
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k_new, v_new)]
    assert all(t.stride(-1) != 1 for t in strided)
    flash_tile.flash_attn_with_kvcache(strided[0], k_cache, v_cache, *strided[1:],
                                       cache_seqlens=lens, cache_batch_idx=idx)
    (_, append), (_, decode) = calls
    assert all(t.stride(-1) == 1 for t in (append[0], append[1], decode[0]))
    assert torch.equal(append[0], k_new) and torch.equal(decode[0], q)
    with pytest.raises(ValueError, match="unit last stride"):
        flash_tile.flash_attn_with_kvcache(q, strided[1], strided[1], cache_seqlens=lens)
    with pytest.raises(ValueError, match="at least one sequence"):
        flash_tile.flash_attn_with_kvcache(q[:0], k_cache, v_cache, cache_seqlens=lens[:0])


@pytest.mark.parametrize("causal,window,q_step", [(True, (-1, -1), 1), (False, (-1, -1), 0),
                                                  (False, (5, -1), 1), (False, (100, 100), 0)])
def test_rotary_and_leftpad_reach_the_launches(monkeypatch, causal, window, q_step):
    """The rotary tables reach the append with q and a fresh buffer for the rotated q, which
    the decode then reads; q rows step through positions when the call is causal or has a
    window bound below the capacity (100 here), as flash-attn's; the pads reach the decode."""
    from flash_tile import _ops_decode

    calls = []
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_ops_decode, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(_ops_decode, "launch_cache_append", lambda *a: calls.append(("append", a)))
    monkeypatch.setattr(_ops_decode, "launch_decode", lambda *a: calls.append(("decode", a)))
    q, k_cache, k_new = _q(2, 3, 8, 64), _q(2, 100, 2, 64), _q(2, 1, 2, 64)
    cos, sin = _q(102, 16), _q(102, 16)  # q's last two rows may sit 2 past the capacity
    lens, pads = (torch.tensor(x, dtype=torch.int32) for x in ([5, 90], [2, 0]))

    def call(cos, sin):
        flash_tile.flash_attn_with_kvcache(q, k_cache, k_cache, k_new, k_new, rotary_cos=cos,
                                           rotary_sin=sin, cache_seqlens=lens,
                                           cache_leftpad=pads, causal=causal,
                                           window_size=window, rotary_interleaved=False)

    if q_step:
        with pytest.raises(ValueError, match="101 rows for 102 positions"):
            call(cos[:101], sin[:101])
    else:
        call(cos[:100], sin[:100])  # all of q at cache_seqlens: the capacity is enough
        calls.clear()
    call(cos, sin)
    (_, append), (_, decode) = calls
    q_arg, q_rot, rotary, kv_descale, int64_index = append[7:]
    assert q_arg is q and q_rot.shape == q.shape and q_rot is not q
    assert rotary == _launch_decode.Rotary(cos, sin, False, q_step)
    assert decode[0] is q_rot and decode[-3] is pads and kv_descale is decode[-2] is None
    assert int64_index is None  # the full path's append works it out


def test_the_append_indexes_the_rows_it_writes_as_the_decode(monkeypatch):
    """A contiguous cache of more rows than the batch (no cache_batch_idx): the append takes
    the 32-bit kernel where the batch's rows keep every offset below 2**31, as the decode's
    plan does, so that the plan's choice can be handed to it; with cache_batch_idx (any row)
    it takes the 64-bit kernel, and a choice given is taken. Meta tensors, the launches
    recorded."""
    import contextlib

    from flash_tile.kernels.attention_decode import cache_append, cache_append_int64

    kernels = []
    monkeypatch.setattr(_launch.ct, "launch", lambda *args, **attributes: kernels.append(
        args[2]))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "device", lambda device: contextlib.nullcontext())
    k = torch.empty(5, 2**20, 4, 128, device="meta", dtype=torch.bfloat16)  # 2**29 a row
    new = torch.empty(2, 1, 4, 128, device="meta", dtype=torch.bfloat16)
    lens, rows = (torch.empty(2, dtype=torch.int32, device="meta") for _ in range(2))
    assert _launch.needs_int64_index(k) and not _launch.needs_int64_index(k[:2])
    _launch_decode.launch_cache_append(new, new, k, k, lens, None, None)
    _launch_decode.launch_cache_append(new, new, k, k, lens, rows, None)
    _launch_decode.launch_cache_append(new, new, k[:2], k[:2], lens, None, None,
                                       int64_index=True)
    assert kernels == [cache_append, cache_append_int64, cache_append_int64]


@pytest.mark.parametrize("poisoned", [False, True])
@pytest.mark.parametrize("big", [False, True])
def test_a_planned_step_hands_its_offsets_choice_to_the_append(monkeypatch, big, poisoned):
    """``_plans.run_kvcache``: the append gets the decode plan's 32/64-bit choice (here with
    cache_batch_idx, so a cache of 2**31 elements takes the 64-bit kernels), on the
    signature's first call and on later ones (by address), and a step that returns no LSE
    allocates none. Meta tensors, the launches recorded; also with the GPU tests' NaN-filling
    allocators (``conftest.poison_outputs``), which must take the planned step's calls as the
    allocators they wrap do."""
    import contextlib

    import conftest
    from flash_tile import _ops_decode, _plans

    if poisoned:
        conftest.poison_outputs(monkeypatch.setattr)

    kernels = []
    monkeypatch.setattr(_launch.ct, "launch", lambda *args, **attributes: kernels.append(
        args[2]))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_launch_decode, "_sm_count", lambda device: 132)
    monkeypatch.setattr(_ops_decode, "device_properties", lambda device: ((9, 0), "H200"))
    meta = {"device": "meta", "dtype": torch.bfloat16}
    k_cache = torch.empty(4, 2**20 if big else 1024, 4, 128, **meta)  # 2**29 elements a row
    q, k_new = torch.empty(2, 1, 16, 128, **meta), torch.empty(2, 1, 4, 128, **meta)
    lens, rows = (torch.empty(2, dtype=torch.int32, device="meta") for _ in range(2))
    plan = _plans.kvcache(q, k_cache, k_cache, rows, None, 0.0, -1, 0, 1, False)
    assert plan.int64_index == big
    for _ in range(2):
        out, lse = _plans.run_kvcache(plan, q, k_cache, k_cache, k_new, k_new, lens, rows,
                                      None, 0.088, 0.0, -1, 0, False, None, None, None, None,
                                      True, 0)
        assert lse is None and out.shape == (2, 1, 16, 128)
    config = decode_variants.default_decode_config((9, 0), 128)
    append = _launch_decode.cache_append_int64 if big else _launch_decode.cache_append
    assert kernels == [append, _launch_decode._decode_kernel(config, big)] * 2


def test_big_caches_run_in_32_bit_launches(monkeypatch):
    """A contiguous cache of 2**31 elements or more runs in launches of as many sequences as
    keep every offset below 2**31, on the 32-bit decode kernel; with cache_batch_idx (any
    row) it stays one launch of the 64-bit kernel. Meta tensors, the launches recorded."""
    import contextlib

    k = torch.empty(5, 2**20, 4, 128, device="meta", dtype=torch.bfloat16)  # 2**29 a row
    assert _launch_decode.int32_batch_rows(k, k) == 3
    assert _launch_decode.int32_batch_rows(k[:, :1]) == 4
    assert _launch_decode.int32_batch_rows(torch.empty(2, 2**22, 4, 128, device="meta")) == 0
    launches = []
    monkeypatch.setattr(_launch.ct, "launch", lambda *args, **attributes: launches.append(
        (*args, attributes)))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "device",
                        lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_launch_decode, "_sm_count", lambda device: 132)
    q = torch.empty(5, 1, 4, 128, device="meta", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.empty(5, device="meta", dtype=torch.int32)
    config = decode_variants.default_decode_config((9, 0), 128)
    _launch_decode.launch_decode(q, k, k, out, None, lens, None, None, None, 0.1, 0.0, (-1, 0),
                                 0, 1, config)
    assert [args[3][1].shape[0] for args in launches] == [3, 2]  # K of 3, then 2 sequences
    assert all(args[4] == {"programmatic_dependent_launch": True} for args in launches)
    assert {args[2] for args in launches} == {_launch_decode._decode_kernel(config, False)}
    launches.clear()
    _launch_decode.launch_decode(q, k, k, out, None, lens, lens, None, None, 0.1, 0.0, (-1, 0),
                                 0, 1, config)
    assert len(launches) == 1 and launches[0][2] is _launch_decode._decode_kernel(config, True)
    assert not decode_variants.default_decode_config((8, 9), 128).pdl  # sm_90 and newer only


@pytest.mark.parametrize("page_size,splits,store_lse,extras,dtype", [
    (None, 1, False, (), torch.bfloat16), (None, 4, True, ("sinks", "leftpad"), torch.float16),
    (16, 1, True, ("sinks",), torch.bfloat16), (64, 4, False, ("leftpad",), torch.bfloat16),
    (None, 2, True, ("batch_idx",), torch.bfloat16), (None, 1, True, ("fp8",), torch.bfloat16),
    (None, 4, True, ("mask",), torch.float16)])
def test_a_planned_decode_launches_what_the_full_path_launches(launched, monkeypatch, page_size,
                                                               splits, store_lse, extras,
                                                               dtype):
    """``AddressedDecode``: from a signature's second call on, the decode (and the combine)
    get what ``launch_decode`` passes for the same call, each array by its CUDA Array
    Interface (the layout of the tensor or view the full path passes, at that tensor's
    address; int32 as "<i4"), everything else equal. A signature with an FP8 cache or a
    mask passes its tensors on every call, as the full path does. Odd shapes (3 query rows,
    GQA 5, D 40 against Dv 24, 713-key caches), q and the caches views at an offset."""
    monkeypatch.setattr(_launch_decode, "_sm_count", lambda device: 132)
    workspaces = {}  # one per size, so that both paths' partials have one address

    def workspace(elements, device):
        return workspaces.setdefault(elements, torch.empty(elements))
    monkeypatch.setattr(_launch_decode, "decode_workspace", workspace)
    batch, q_len, kv_heads, group, d, dv = 2, 3, 2, 5, 40, 24
    cache_dtype = _validate.FP8_DTYPE if "fp8" in extras else dtype

    def arrays():  # fresh arrays of one signature, as launch_decode takes them
        # Caches past a pool's first row and q among other heads: views whose address is
        # not their storage's
        if page_size is None:
            caches = (torch.randn(4, 713, kv_heads, n).to(cache_dtype)[1:] for n in (d, dv))
            table = None
        else:
            caches = (torch.randn(33, page_size, kv_heads, n).to(cache_dtype)[1:]
                      for n in (d, dv))
            table = torch.randperm(32, dtype=torch.int32).view(batch, 16)
        k_cache, v_cache = caches
        heads = kv_heads * group
        return dict(
            q=_q(batch, q_len, heads + 3, d, dtype=dtype)[:, :, 3:], k_cache=k_cache,
            v_cache=v_cache,
            out=torch.empty(batch, q_len, heads, dv, dtype=dtype),
            lse=torch.empty(batch, heads, q_len) if store_lse else None,
            seqlens_k=torch.tensor([200, 7], dtype=torch.int32),
            batch_idx=(torch.tensor([2, 0], dtype=torch.int32) if "batch_idx" in extras
                       else None), block_table=table, alibi_slopes=None,
            sinks=torch.randn(heads) if "sinks" in extras else None,
            leftpad=torch.tensor([3, 0], dtype=torch.int32) if "leftpad" in extras else None,
            kv_descale=((torch.rand(batch, kv_heads), torch.rand(batch, kv_heads))
                        if "fp8" in extras else None),
            attn_mask=(torch.rand(batch, 1, q_len, table.shape[1] * page_size if table is
                                  not None else 713) > 0.3 if "mask" in extras else None))

    def launch(launcher, a, *more):
        launcher(a["q"], a["k_cache"], a["v_cache"], a["out"], a["lse"], a["seqlens_k"],
                 a["batch_idx"], a["block_table"], a["alibi_slopes"], 0.125, 0.0, (-1, 0), 1,
                 *more, sinks=a["sinks"], leftpad=a["leftpad"], kv_descale=a["kv_descale"],
                 attn_mask=a["attn_mask"])

    config = decode_variants.default_decode_config((9, 0), d)
    first, second = arrays(), arrays()
    plan = _launch_decode.decode_plan(
        first["q"], first["k_cache"], first["v_cache"], store_lse, first["batch_idx"],
        first["block_table"], None, 0.0, (-1, 0), splits, config, first["sinks"],
        first["leftpad"], "mask" in extras)
    assert plan.splits == splits
    addressed = _plans.AddressedDecode(plan)
    launch(addressed.launch, first)  # records the signature's layouts
    del launched[:]
    launch(_launch_decode.launch_decode, second, splits, config)
    full = launched[:]
    del launched[:]
    launch(addressed.launch, second)
    assert len(launched) == len(full) == (2 if splits > 1 else 1)
    by_address = not {"fp8", "mask"} & set(extras)
    for (grid, kernel, args), (plan_grid, plan_kernel, plan_args) in zip(full, launched):
        assert plan_grid == grid and plan_kernel is kernel and len(plan_args) == len(args)
        for i, (was, now) in enumerate(zip(args, plan_args)):
            if isinstance(was, torch.Tensor) and by_address:
                assert now.__cuda_array_interface__ == array_interface(was), i
            elif isinstance(was, torch.Tensor):
                assert now.data_ptr() == was.data_ptr() and now.stride() == was.stride(), i
                assert now.shape == was.shape and now.dtype == was.dtype, i
            elif hasattr(was, "__cuda_array_interface__"):  # the split partials
                assert now.__cuda_array_interface__ == was.__cuda_array_interface__, i
            else:
                assert now == was and type(now) is type(was), i


@pytest.mark.parametrize("page_size,extras", [
    (None, ()), (None, ("rotary", "batch_idx")), (16, ("rotary",)), (64, ()),
    (None, ("fp8",))])
def test_a_planned_append_launches_what_the_full_path_launches(launched, page_size, extras):
    """``AddressedDecode.append``: from a signature's second call on, the append gets what
    ``launch_cache_append`` passes for the same call, each array by its interface at that
    tensor's address (q and the rotated q as their grouped views), the rest equal; into an
    FP8 cache (bf16 rows quantized on the way) it passes its tensors every call. Two new rows
    of 3 query rows, GQA 5, D 40 against Dv 24."""
    batch, kv_heads, group, d, dv = 2, 2, 5, 40, 24
    cache_dtype = _validate.FP8_DTYPE if "fp8" in extras else torch.bfloat16

    def arrays():
        if page_size is None:  # (views past a pool's first row, as q and the new rows)
            caches = [torch.randn(4, 713, kv_heads, n).to(cache_dtype)[1:] for n in (d, dv)]
            table = None
        else:
            caches = [torch.randn(33, page_size, kv_heads, n).to(cache_dtype)[1:]
                      for n in (d, dv)]
            table = torch.randperm(32, dtype=torch.int32).view(batch, 16)
        rotary = None
        if "rotary" in extras:
            rotary = _launch_decode.Rotary(_q(800, 8), _q(800, 8), False, 1)
        q = _q(batch, 3, kv_heads * group + 1, d)[:, :, 1:]
        return (_q(batch, 3, kv_heads, d)[:, 1:], _q(batch, 3, kv_heads, dv)[:, 1:], *caches,
                torch.tensor([200, 7], dtype=torch.int32),
                torch.tensor([2, 0], dtype=torch.int32) if "batch_idx" in extras else None,
                table, q, torch.empty_like(q), rotary,
                (torch.rand(batch, kv_heads), torch.rand(batch, kv_heads))
                if "fp8" in extras else None, False)

    addressed = _plans.AddressedDecode(None)  # the append needs no decode plan
    addressed.append(*arrays())
    second = arrays()
    del launched[:]
    _launch_decode.launch_cache_append(*second)
    addressed.append(*second)
    (grid, kernel, args), (plan_grid, plan_kernel, plan_args) = launched
    assert plan_grid == grid and plan_kernel is kernel and len(plan_args) == len(args)
    for i, (was, now) in enumerate(zip(args, plan_args)):
        if isinstance(was, torch.Tensor) and "fp8" not in extras:
            assert now.__cuda_array_interface__ == array_interface(was), i
        elif isinstance(was, torch.Tensor):
            assert now.data_ptr() == was.data_ptr() and now.stride() == was.stride(), i
            assert now.shape == was.shape and now.dtype == was.dtype, i
        else:
            assert now == was and type(now) is type(was), i
    assert ("rotary" in extras) == isinstance(args[7], torch.Tensor)
