"""The autotuner's logic on the CPU: problem classes, the choice among timed variants (a fast
wrong one never wins), the on-disk cache and the off switch. Timing and launches are stand-ins
here; tests/test_gpu_variants.py tunes real kernels."""

import itertools
import json

import pytest
import torch

from flash_tile import autotune, variants

A = variants.TileConfig(tile_m=64, tile_n=64, occupancy=2)
B = variants.TileConfig(tile_m=128, tile_n=64, occupancy=2)
C = variants.TileConfig(tile_m=64, tile_n=128)


def _key(**overrides):
    args = dict(backward=False, capability=(9, 0), dtype=torch.bfloat16, head_dim=128,
                v_head_dim=128, q_len=4096, k_len=4096, group=1, window=(-1, 0),
                softcap=False, alibi=False, mask_kind=None)
    args.update(overrides)
    return autotune.problem_key(**args)


def test_problem_key_names_every_field():
    assert _key() == "fwd|sm_90|bfloat16|d128x128|causal|group1|plain|q4096|k4096"
    assert _key(backward=True, head_dim=72, v_head_dim=40, window=(64, 0), softcap=True,
                alibi=True, mask_kind="bool", group=4, q_len=1, k_len=100000) == \
        "bwd|sm_90|bfloat16|d128x64|window|group4|softcap+alibi+bool-mask|q64|k16384"
    assert _key(window=(-1, -1)).split("|")[4] == "full"


def test_describe_tells_every_registered_variant_apart():
    """The tuner keys its timings by ``describe``: two variants with one name would share a
    time. Hints and schedule switches appear only when they differ from the defaults."""
    assert autotune.describe(A) == "64x64 occupancy=2"
    assert autotune.describe(variants.TileConfig(latency_k=8, latency_v=8)) == \
        "64x64 latency=8/8"
    assert autotune.describe(variants.TileConfig(tile_n=128, num_worker_warps=8,
                                                 group_inner=True, dq_tile_m=128)) == \
        "64x128 num_worker_warps=8 group_inner dq=128x128"
    assert autotune.describe(variants.TileConfig(dq_tile_m=64)) == "64x64 dq=64x64"
    assert autotune.describe(variants.SM90_FP8) == "128x256 num_worker_warps=8 exp2_fma=4"
    for backward in (False, True):
        for capability in ((8, 0), (9, 0), (10, 0), (12, 0)):
            configs = {c for _, c in variants.registered(capability, backward)}
            assert len({autotune.describe(c) for c in configs}) == len(configs)


@pytest.mark.parametrize("length,bucket", [(1, 64), (64, 64), (65, 128), (1000, 1024),
                                           (4096, 4096), (4097, 8192), (300000, 16384)])
def test_length_buckets(length, bucket):
    assert autotune.length_bucket(length) == bucket


def _runner(outputs, calls=None):
    """run(config) returning fixed outputs per config, recording the calls."""
    def run(config):
        if calls is not None:
            calls.append(config)
        result = outputs[config]
        if isinstance(result, Exception):
            raise result
        return tuple(t.clone() for t in result)
    return run


def _tune(outputs, times):
    last = []

    def run(config):
        last.append(config)
        return _runner(outputs)(config)

    best, results = autotune.tune([A, B, C], run, time_ms=lambda fn: (fn(), times[last[-1]])[1])
    return best, results


def test_the_fastest_correct_variant_wins():
    out = torch.randn(4, 8, dtype=torch.bfloat16)
    rounded_differently = out + torch.finfo(torch.bfloat16).eps * out.sign()  # about an ulp
    best, results = _tune({A: (out,), B: (rounded_differently,), C: (out,)},
                          {A: 1.0, B: 0.5, C: 0.7})
    assert best == B
    assert results == {"64x64 occupancy=2": 1.0, "128x64 occupancy=2": 0.5, "64x128": 0.7}


def test_a_fast_wrong_variant_never_wins():
    out = torch.randn(4, 8)
    wrong = out.clone()
    wrong[2, 3] += 0.5  # one element off: a dropped or repeated tile looks like this
    best, results = _tune({A: (out,), B: (wrong,), C: (out,)}, {A: 1.0, B: 0.1, C: 0.7})
    assert best == C
    assert results["128x64 occupancy=2"].startswith("rejected")


def test_a_wrong_variant_is_rejected_at_attention_output_scale():
    """bf16 outputs of a long row are small (~1/sqrt(L)): a tile's worth of error there is far
    below 1, and must still be rejected, while an ulp of rounding is not."""
    out = (torch.randn(64, 128) * 0.02).to(torch.bfloat16)
    rounded = (out.float() * (1 + torch.finfo(torch.bfloat16).eps)).to(torch.bfloat16)
    wrong = out.clone()
    wrong[5, 7] += 0.01
    best, results = _tune({A: (out,), B: (wrong,), C: (rounded,)}, {A: 1.0, B: 0.1, C: 0.5})
    assert best == C
    assert results["128x64 occupancy=2"].startswith("rejected")


def test_infinities_must_match_and_nan_is_rejected():
    lse = torch.tensor([1.0, float("inf"), 2.0])
    finite = torch.tensor([1.0, 5.0, 2.0])
    nan = torch.tensor([1.0, float("inf"), float("nan")])
    best, results = _tune({A: (lse,), B: (finite,), C: (nan,)}, {A: 1.0, B: 0.1, C: 0.1})
    assert best == A
    assert all(results[n].startswith("rejected") for n in ("128x64 occupancy=2", "64x128"))


def test_the_check_compares_only_what_the_kernels_write():
    """Varlen leaves the rows outside every sequence unwritten: whatever an allocation held
    there (NaN here, different on every call) must not reject a correct variant, nor the
    default itself; ``written`` masks them before the check."""
    def run(config):
        out = torch.randn(6, generator=torch.Generator().manual_seed(0))
        out[-2:] = torch.nan if config != A else torch.rand(2)
        return (out,)

    with pytest.raises(autotune.NotTunable, match="NaN"):  # unmasked, the default's NaN
        autotune.tune([B, C], run, time_ms=lambda fn: 1.0)
    best, results = autotune.tune([A, B, C], run, time_ms=lambda fn: (fn(), 1.0)[1],
                                  written=lambda outputs: (outputs[0][:-2],))
    assert best == A and all(isinstance(results[autotune.describe(c)], float)
                             for c in (A, B, C))


def test_candidates_are_timed_in_rounds_and_ranked_by_their_median():
    """Every candidate once per round, in registry order and every other round reversed, so
    that a drift of the GPU over the tuning run weighs on all of them; one slow round (a clock
    dip) does not decide."""
    out = torch.randn(3)
    timed = []
    last = []

    def run(config):
        last.append(config)
        return (out.clone(),)

    samples = {A: iter([1.1, 1.1, 1.1]), B: iter([0.8, 5.0, 1.0]), C: iter([1.2, 1.2, 1.2])}

    def time_ms(fn):
        fn()
        timed.append(last[-1])
        return next(samples[last[-1]])

    best, results = autotune.tune([A, B, C], run, time_ms=time_ms)
    assert timed == [c for r in range(autotune._ROUNDS)
                     for c in ([A, B, C] if r % 2 == 0 else [C, B, A])]
    assert best == B and results["128x64 occupancy=2"] == 1.0  # the median, not the mean or min
    assert list(results) == ["64x64 occupancy=2", "128x64 occupancy=2", "64x128"]


def test_a_variant_that_fails_to_build_loses_but_a_failing_default_raises():
    out = torch.randn(3)
    best, results = _tune({A: (out,), B: RuntimeError("tileiras: out of registers"), C: (out,)},
                          {A: 1.0, C: 2.0})
    assert best == A and results["128x64 occupancy=2"].startswith("failed: tileiras")
    with pytest.raises(RuntimeError, match="boom"):  # as the call would without tuning
        autotune.tune([B], _runner({B: RuntimeError("boom")}), time_ms=lambda fn: 1.0)


def test_cache_round_trip_and_a_corrupt_file(tmp_path):
    path = tmp_path / "sub" / "autotune-x.json"
    cache = autotune.Cache(path)
    assert cache.get("k") is None
    cache.put("k", B, {"128x64 occupancy=2": 0.5})
    assert autotune.Cache(path).get("k") == B  # a new process reads it back
    assert json.loads(path.read_text())["entries"]["k"]["results"] == {"128x64 occupancy=2": 0.5}
    other = autotune.Cache(path)  # a second process, tuning another class meanwhile
    cache.put("k2", C, {})
    other.put("k3", A, {})
    assert set(autotune.Cache(path).entries) == {"k", "k2", "k3"}  # neither write is lost
    path.write_text("{not json")
    assert autotune.Cache(path).get("k") is None  # tuned again, not a crash
    path.write_text(json.dumps({"entries": {"k": {"config": {"tile_m": 48}}}}))
    assert autotune.Cache(path).get("k") is None  # not a valid config: tuned again


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "cache_path", lambda device: tmp_path / "autotune-test.json")
    autotune.clear_memory_cache()
    yield tmp_path
    autotune.clear_memory_cache()


def test_choose_tunes_once_then_reads_the_cache(cache_dir, monkeypatch):
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    out = torch.randn(5)
    calls = []
    run = _runner({A: (out,), B: (out,), C: (out,)}, calls)
    times = itertools.cycle([3.0, 1.0, 2.0])  # A, B, C in every round
    monkeypatch.setattr(autotune, "cuda_time_ms", lambda fn, *a: (fn(), next(times))[1])
    assert autotune.choose("k", torch.device("cpu"), [A, B, C], run) == B
    calls.clear()
    autotune.clear_memory_cache()  # a new process: from the file, with nothing launched
    assert autotune.choose("k", torch.device("cpu"), [A, B, C], run) == B
    assert calls == []


def test_a_class_another_process_tuned_meanwhile_is_read_not_tuned(cache_dir, monkeypatch):
    """This process read the file before another one (a torchrun rank) wrote its winner: the
    lookup before tuning reads the file again and takes it."""
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert autotune._cache_for(torch.device("cpu")).get("k") is None  # read: nothing yet
    autotune.Cache(cache_dir / "autotune-test.json").put("k", B, {})  # the other process
    calls = []
    assert autotune.choose("k", torch.device("cpu"), [A, B],
                           _runner({A: (torch.ones(1),), B: (torch.ones(1),)}, calls)) == B
    assert calls == []


def test_a_cached_winner_no_longer_registered_is_tuned_again(cache_dir, monkeypatch):
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    autotune.Cache(cache_dir / "autotune-test.json").put("k", C, {})  # tuned with C, since gone
    out = torch.randn(5)
    times = itertools.cycle([3.0, 1.0])
    monkeypatch.setattr(autotune, "cuda_time_ms", lambda fn, *a: (fn(), next(times))[1])
    assert autotune.choose("k", torch.device("cpu"), [A, B], _runner({A: (out,), B: (out,)})) \
        == B


def test_the_cache_file_changes_with_the_registry(monkeypatch):
    """A source checkout keeps its version number: the registry's (and the kernels') digest
    names the cache file too."""
    before = autotune.code_digest()
    monkeypatch.setitem(variants._FORWARD_CANDIDATES, (9, 0), ((256, A),))
    assert autotune.code_digest() != before


def test_switched_off_or_capturing_gives_the_default_untimed(cache_dir, monkeypatch):
    def run(config):
        raise AssertionError("nothing may launch")

    monkeypatch.setenv(autotune.ENV_SWITCH, "0")
    assert not autotune.enabled()
    assert autotune.choose("k", torch.device("cpu"), [A, B], run) == A
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert autotune.choose("k", torch.device("cpu"), [A, B], run) is None  # not decided
    assert not (cache_dir / "autotune-test.json").exists()


def test_nan_results_defer_tuning_to_a_later_call(cache_dir, monkeypatch):
    """Inputs that make the default's result NaN (inf gradients in the first steps of fp16
    training under a GradScaler) leave nothing to check candidates against: this call gets
    no choice (the caller launches the default), nothing is cached, and the _ops layer asks
    again on the class's next call."""
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(autotune, "cuda_time_ms", lambda fn, *a: (fn(), 1.0)[1])
    bad = torch.tensor([1.0, float("nan")])
    assert autotune.choose("k", torch.device("cpu"), [A, B], _runner({A: (bad,), B: (bad,)})) \
        is None
    assert not (cache_dir / "autotune-test.json").exists()
    good = torch.randn(2)  # equal times: the default stays
    assert autotune.choose("k", torch.device("cpu"), [A, B],
                           _runner({A: (good,), B: (good,)})) == A


def test_a_candidate_that_skips_its_stores_is_rejected_on_reused_memory():
    """Each checked run's outputs are filled with NaN before they are freed: a candidate that
    leaves its output unwritten and gets the last run's block back (the caching allocator's
    habit) finds NaN there, not the right values."""
    pool = torch.empty(4)
    want = torch.randn(4)

    def run(config):  # A and C store; B returns the block as the last run left it
        if config != B:
            pool.copy_(want)
        return (pool,)

    best, results = autotune.tune([A, B, C], run, time_ms=lambda fn: 1.0)
    assert results[autotune.describe(B)].startswith("rejected")
    assert isinstance(results[autotune.describe(C)], float)


def _no_home():
    raise RuntimeError("Could not determine home directory")


@pytest.mark.parametrize("where", ["a file in the way", "no home directory"])
def test_an_unwritable_cache_keeps_the_winners_in_memory(tmp_path, monkeypatch, where):
    """A cache directory that cannot be made (a file stands where it would be: a warning) or a
    machine without a home directory (Path.home() raises): the winner is used and kept for
    this process instead of failing the user's call, and no temporary file is left."""
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(autotune, "cuda_time_ms", lambda fn, *a: (fn(), 1.0)[1])
    (tmp_path / "file").write_text("")
    if where == "no home directory":  # cache_path itself: no directory to name
        monkeypatch.delenv(autotune.ENV_CACHE_DIR, raising=False)
        monkeypatch.setattr(autotune.Path, "home", staticmethod(_no_home))
        assert autotune.cache_path(torch.device("cpu")) is None
    else:
        monkeypatch.setattr(autotune, "cache_path",
                            lambda device: tmp_path / "file" / "autotune-test.json")
    autotune.clear_memory_cache()
    out, calls = torch.randn(3), []
    run = _runner({A: (out,), B: (out,)}, calls)
    if where == "a file in the way":
        with pytest.warns(RuntimeWarning, match="cannot write"):
            first = autotune.choose("k", torch.device("cpu"), [A, B], run)
    else:
        first = autotune.choose("k", torch.device("cpu"), [A, B], run)
    assert first == A  # equal times: the default stays
    calls.clear()
    assert autotune.choose("k", torch.device("cpu"), [A, B], run) == first
    assert calls == []  # kept in memory: not tuned twice
    assert not list(tmp_path.glob("**/*.tmp"))
    autotune.clear_memory_cache()


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("plain", [False, True])
def test_candidates_start_with_the_default_and_fit_the_head_dim(capability, head_dim, backward,
                                                                plain):
    configs = variants.candidates(capability, head_dim, backward, plain)
    default = (variants.default_backward_config(capability, head_dim, plain) if backward
               else variants.default_config(capability, head_dim))
    assert configs[0] == default
    assert len(set(configs)) == len(configs)
    # Exactly the entries registered for this head dim or wider ones, the default among them
    # (so the AOT tests compile it).
    fitting = {c for max_dim, c in variants.registered(capability, backward)
               if head_dim <= max_dim}
    assert set(configs) == fitting


def test_plain_classes_get_their_own_backward_default_only_where_one_is_registered():
    """sm_90 at D=128: 64x64 o2 for plain scores, the tile that holds its registers under
    dropout and the score features otherwise (variants._PLAIN_BACKWARD); elsewhere one
    default for both."""
    def pick(capability, head_dim, plain):
        return autotune.describe(variants.default_backward_config(capability, head_dim, plain))

    assert pick((9, 0), 128, True) == "64x64 occupancy=2"
    assert pick((9, 0), 128, False) == "32x64 occupancy=2 dq=64x64"
    assert pick((9, 0), 96, True) == "64x64 occupancy=2"
    for capability, head_dim in [((9, 0), 64), ((9, 0), 256), ((8, 0), 128), ((10, 0), 128),
                                 ((12, 0), 64)]:
        assert pick(capability, head_dim, True) == pick(capability, head_dim, False)
    # Which classes are plain: autotune.problem_key's "plain", the same four features.
    assert variants.is_plain(False, False, None, False)
    for features in [(True, False, None, False), (False, True, None, False),
                     (False, False, "bool", False), (False, False, "additive", False),
                     (False, False, None, True)]:
        assert not variants.is_plain(*features), features


@pytest.mark.parametrize("head_dim,backward,expected", [
    (64, False, ["64x64 occupancy=3", "128x128 num_worker_warps=8", "128x64 num_worker_warps=8",
                 "128x64 occupancy=2", "64x64 occupancy=4", "64x128 occupancy=2"]),
    (128, False, ["128x128 num_worker_warps=8", "128x64 num_worker_warps=8",
                  "128x64 occupancy=2", "64x128 occupancy=2"]),
    (256, False, ["128x64 num_worker_warps=8"]),
    (64, True, ["64x64 occupancy=2", "32x64 occupancy=2 dq=64x64",
                "64x64 num_worker_warps=8 dq=128x32", "128x64 occupancy=2 dq=64x64",
                "128x64 num_worker_warps=8",
                "64x128 num_worker_warps=8 dq=128x64", "64x64 num_worker_warps=8",
                "64x128 num_worker_warps=8 one_pass",
                "64x64 num_worker_warps=8 one_pass dq=128x32"]),
    (128, True, ["32x64 occupancy=2 dq=64x64", "64x64 num_worker_warps=8 dq=128x32",
                 "64x64 occupancy=2", "128x64 num_worker_warps=8",
                 "64x128 num_worker_warps=8 dq=128x64", "64x64 num_worker_warps=8",
                 "64x128 num_worker_warps=8 one_pass",
                "64x64 num_worker_warps=8 one_pass dq=128x32"]),
    (256, True, ["64x64 num_worker_warps=8 one_pass dq=128x32",
                 "64x64 num_worker_warps=8 dq=128x32",
                 "64x64 num_worker_warps=8"]),
])
def test_sm90_candidates_are_those_registered_for_the_head_dim(head_dim, backward, expected):
    """The H200's lists, written out: an entry's largest head dim keeps it out of wider heads,
    and the default of the head dim's bucket comes first."""
    assert [autotune.describe(c) for c in variants.candidates((9, 0), head_dim, backward)] \
        == expected


def test_the_gpu_feature_test_gives_every_registered_tile_all_three_runs():
    """tests/test_gpu_variants.py runs every forward candidate under a two-sided window; it
    asserts that some query tile sees masked, unmasked and masked key tiles. Checked here for
    every registered forward tile of every architecture, so that a new entry that the window
    is too narrow for fails on the CPU, not first on a GPU."""
    from flash_tile.reference import kv_tile_runs
    from test_gpu_variants import FEATURE_K_LEN, FEATURE_WINDOW

    for arch in variants.ARCHS:
        for _, config in variants.registered(variants.capability_of(arch)):
            runs = [kv_tile_runs(m, config.tile_m, config.tile_n, FEATURE_K_LEN,
                                 FEATURE_K_LEN - 203, FEATURE_WINDOW)
                    for m in range(0, 203, config.tile_m)]
            assert any(a < b < c < d for a, b, c, d in runs), (arch, config, runs)


def test_each_call_looks_its_variant_up_once_per_problem(cache_dir, monkeypatch):
    """``_ops._choose``, which runs on every call: the default when tuning is off, otherwise
    one tuning per problem class (dropout and the length bucket are part of it) and dict hits
    after that."""
    from flash_tile import _ops

    monkeypatch.setattr(_ops, "device_properties", lambda device: ((9, 0), "NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    keys = []

    def fake_choose(key, device, configs, run, written=None):
        keys.append(key)
        return configs[1]

    monkeypatch.setattr(autotune, "choose", fake_choose)
    q = torch.empty(2, 8, 1000, 128, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 2, 1000, 128, device="meta", dtype=torch.bfloat16)

    def pick(dropout_p=0.0, q=q):
        return _ops._choose(False, q, kv, kv, (-1, 0), 0.0, None, None, dropout_p, None)

    monkeypatch.setenv(autotune.ENV_SWITCH, "0")
    assert pick() == variants.default_config((9, 0), 128) and keys == []
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    first = pick()
    assert first == variants.candidates((9, 0), 128)[1]
    assert pick() == first and pick(q=q[:, :, :900]) == first  # same bucket: no new tuning
    pick(dropout_p=0.1)
    assert keys == ["fwd|sm_90|bfloat16|d128x128|causal|group4|plain|q1024|k1024",
                    "fwd|sm_90|bfloat16|d128x128|causal|group4|dropout|q1024|k1024"]


def test_varlen_calls_are_tuned_by_their_mean_length_on_their_written_rows(cache_dir,
                                                                            monkeypatch):
    """The varlen ops choose through the tuner too, in classes of their own keyed by the
    packing's mean sequence length, and check candidates on the rows some sequence covers
    (the kernels leave the others unwritten)."""
    from flash_tile import _ops

    monkeypatch.setattr(_ops, "device_properties", lambda device: ((9, 0), "NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    keys, launched = [], []

    def fake_choose(key, device, configs, run, written=None):
        outputs = written(run(configs[1]))
        assert all(t.isfinite().all() for t in outputs)  # the unwritten rows masked
        keys.append(key)
        return configs[1]

    def fake_launch(q, k, v, out, lse, *args):
        launched.append(args[6])  # the config
        out[:] = torch.nan  # what an allocation may hold ...
        out[:, :, 3:900] = 1.0  # ... and the rows the sequences cover, written
        if lse is not None:
            lse[:] = torch.nan
            lse[:, :, 3:900] = 0.0

    monkeypatch.setattr(autotune, "choose", fake_choose)
    monkeypatch.setattr(_ops, "launch_forward", fake_launch)
    q = torch.randn(1000, 8, 64, dtype=torch.bfloat16)
    kv = torch.randn(1000, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([3, 200, 700, 900], dtype=torch.int32)  # 3 sequences: mean 333
    out, lse = _ops._varlen_forward_impl(q, kv, kv, cu, cu, None, 1.0, 0.0, -1, 0, True)
    assert keys == ["fwd|sm_90|bfloat16|d64x64|causal|group4|varlen|q512|k512"]
    assert _ops.problem_key(False, q, kv, kv, (-1, 0), 0.0, None, None, 0.0, 3) == keys[0]
    assert launched[-1] == variants.candidates((9, 0), 64)[1]

    # The backward: dq on the queries' rows, dk and dv on the keys' (other offsets here).
    def fake_backward(dout, q, k, v, out, lse, dq, dk, dv, *args):
        launched.append(args[7])  # the config
        for grad, (lo, hi) in ((dq, (3, 900)), (dk, (10, 950)), (dv, (10, 950))):
            grad[:] = torch.nan
            grad[:, :, lo:hi] = 1.0

    monkeypatch.setattr(_ops, "launch_backward", fake_backward)
    cu_k = torch.tensor([10, 100, 500, 950], dtype=torch.int32)
    grads = _ops._varlen_backward_impl(q, q, kv, kv, q, lse, None, cu, cu_k, None, 1.0, 0.0,
                                       -1, 0)
    assert keys[-1] == "bwd|sm_90|bfloat16|d64x64|causal|group4|varlen|q512|k512"
    assert launched[-1] == variants.candidates((9, 0), 64, backward=True, plain=True)[1]
    assert all(g.shape == t.shape for g, t in zip(grads, (q, kv, kv)))

    # No query rows: nothing launched, nothing tuned.
    count = len(launched)
    assert _ops._varlen_forward_impl(q[:0], kv, kv, cu * 0, cu, None, 1.0, 0.0, -1, 0,
                                     False)[0].shape == (0, 8, 64)
    assert len(keys) == 2 and len(launched) == count
    autotune.decided.clear()
    monkeypatch.setenv(autotune.ENV_SWITCH, "0")
    _ops._varlen_forward_impl(q, kv, kv, cu, cu, None, 1.0, 0.0, -1, 0, False)
    assert len(keys) == 2 and launched[-1] == variants.default_config((9, 0), 64)


def test_deterministic_backward_is_a_class_of_two_pass_candidates():
    """A deterministic backward never times (nor defaults to) a one-pass variant, whose dQ is
    summed by atomic adds, and is tuned as a class of its own."""
    for head_dim in (64, 128, 256):
        fast = variants.candidates((9, 0), head_dim, backward=True)
        exact = variants.candidates((9, 0), head_dim, backward=True, deterministic=True)
        assert any(c.one_pass for c in fast) and not any(c.one_pass for c in exact)
        assert set(exact) < set(fast)
        assert not variants.default_backward_config((9, 0), head_dim,
                                                    deterministic=True).one_pass
    assert variants.default_backward_config((9, 0), 256).one_pass
    assert not variants.default_backward_config((9, 0), 128).one_pass
    for capability in ((8, 0), (10, 0), (12, 0)):  # no TMA reduce timed there: two passes
        assert not any(c.one_pass for c in variants.candidates(capability, 128, backward=True))
    args = dict(backward=True, capability=(9, 0), dtype=torch.bfloat16, head_dim=128,
                v_head_dim=128, q_len=1024, k_len=1024, group=1, window=(-1, 0),
                softcap=False, alibi=False, mask_kind=None)
    assert autotune.problem_key(**args, deterministic=True) == \
        autotune.problem_key(**args).replace("|plain|", "|deterministic|")
