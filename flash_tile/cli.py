"""The ``flash-tile`` command.

    flash-tile demo [--arch sm_90]     the main job: on a GPU, attention through the kernel
                                       checked against SDPA and timed; without one, compile the
                                       kernel for --arch, summarise its SASS, run the CPU twin
    flash-tile inspect --arch sm_90    compile one variant for any arch (no GPU needed) and show
                                       what it becomes: tensor-core, TMA, exp2, barrier counts,
                                       registers, shared memory, top opcodes, Tile IR ops
    flash-tile doctor                  what this machine has (GPU, driver, torch, cuda-tile,
                                       tileiras), which variant it gets, and a smoke test
    flash-tile tune [--backward] [--varlen]
                                       pre-tune a grid of shapes into the autotune cache
    flash-tile bench [forward|backward|context-parallel|decode|decode-variants|features|fp8|
                      launch|sinks|variants|varlen] [ARGS]
                                       the benchmarks of the source tree's bench/ (table, JSON,
                                       plot); ARGS go to the script (--help lists them)

Errors print one line with the fix; ``--traceback`` shows the whole trace.
"""

import argparse
import dataclasses
import os
import subprocess
import sys

import torch
from tqdm import tqdm

from flash_tile import _timing, _validate, aot, autotune, variants


def _print_compile_summary(arch, dtype, head_dim, causal, config, sass_out=None,
                           tile_ir_out=None):
    print(f"compiling the forward for {arch}: {dtype}, D={head_dim}, "
          f"{'causal' if causal else 'not causal'}, {autotune.describe(config)}")
    fp8 = dtype == "float8_e4m3fn"  # the FP8 forward (e4m3 Q, K, V^T)
    cubin = aot.compile_forward(arch, dtype, head_dim, causal=causal, even_n=False,
                                store_lse=True, config=config, fp8=fp8)
    sass = aot.disassemble(cubin)
    summary = aot.summarize(sass)
    usage = aot.resource_usage(cubin)
    tc = (aot.FP8_TENSOR_CORE_OP if fp8 else aot.TENSOR_CORE_OP).get(arch, "?")
    print(f"  cubin {len(cubin)} bytes, {summary['instructions']} SASS instructions, "
          f"{usage['registers']} registers/thread, {usage['shared_bytes']} B shared memory")
    print(f"  tensor-core matmuls ({tc} expected): {summary['tensor_core']}   "
          f"TMA loads: {summary['tma_load']}   exp2 (MUFU.EX2): {summary['exp2']}   "
          f"barriers: {summary['barrier']}   local-memory spills: {summary['local_memory']}")
    print("  top opcodes: " + ", ".join(f"{op} {n}" for op, n in aot.opcode_histogram(sass, 8)))
    if sass_out:
        with open(sass_out, "w") as f:
            f.write(sass)
        print(f"  full SASS written to {sass_out}")
    tile_ir = aot.disassemble_tile_ir(aot.compile_forward(
        arch, dtype, head_dim, causal=causal, even_n=False, store_lse=True, config=config,
        output_format="tileir_bytecode", fp8=fp8))
    print("  top Tile IR ops: " + ", ".join(f"{op} {n}" for op, n in aot.tile_ir_ops(tile_ir, 10)))
    if tile_ir_out:
        with open(tile_ir_out, "w") as f:
            f.write(tile_ir)
        print(f"  full Tile IR written to {tile_ir_out}")


def _config_for(arch, head_dim, tile_m=None, tile_n=None, fp8=False, causal=False,
                key_len=None):
    capability = variants.capability_of(arch)
    config = (variants.fp8_config(capability, head_dim, causal, key_len) if fp8 else
              variants.default_config(capability, head_dim))
    # The default's hints, with the asked-for tile shape.
    return dataclasses.replace(config, tile_m=tile_m or config.tile_m,
                               tile_n=tile_n or config.tile_n)


def _cpu_reference_demo():
    from flash_tile.reference import attention_tiles

    q, k, v = (torch.randn(2, 4, n, 64, dtype=torch.float64) for n in (203, 113, 113))
    out, _ = attention_tiles(q, k, v, window=(-1, 0))  # causal, top-left like SDPA
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    print("CPU tile reference (float64, 64x64 tiles, the kernel's loop) vs torch SDPA, "
          f"[2, 4, 203/113, 64] causal: max error {(out - ref).abs().max().item():.2e}")


def _check_against_sdpa(q, k, v, causal):
    """flash_tile's SDPA function on [B, H, L, D] inputs, checked with the tolerance rule
    against torch SDPA in fp32 (reference) and in the input dtype (torch's own error)."""
    import flash_tile
    from flash_tile.reference import check_error

    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return check_error(out, sdpa(q.float(), k.float(), v.float(), is_causal=causal),
                       sdpa(q, k, v, is_causal=causal))


def _gpu_demo():
    import flash_tile
    from flash_tile._timing import cuda_time_ms, flops

    device = torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(device)
    print(f"GPU: {torch.cuda.get_device_name(device)} ({variants.arch_name(capability)}), "
          f"default forward variant {autotune.describe(variants.default_config(capability))} "
          f"(the autotuner may pick another)")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print(f"{'B':>3} {'H':>3} {'L':>6} {'D':>4} {'causal':>6}  {'max err':>8} {'torch err':>9}"
          f"  {'flash_tile':>10} {'SDPA':>9}  ratio")
    for batch, heads, length, head_dim in [(4, 16, 1024, 128), (2, 16, 4096, 128),
                                           (2, 32, 4096, 64)]:
        for causal in (False, True):
            q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(3))
            report = _check_against_sdpa(q, k, v, causal)
            if not report["ok"]:
                raise RuntimeError(f"wrong result against SDPA: {report}")
            f = flops(batch, heads, length, length, head_dim, causal) / 1e9
            ours = cuda_time_ms(lambda: flash_tile.scaled_dot_product_attention(
                q, k, v, is_causal=causal))
            theirs = cuda_time_ms(lambda: sdpa(q, k, v, is_causal=causal))
            print(f"{batch:>3} {heads:>3} {length:>6} {head_dim:>4} {str(causal):>6}  "
                  f"{report['max_err']:8.1e} {report['max_err_torch']:9.1e}  "
                  f"{f / ours:6.0f} TF/s {f / theirs:5.0f} TF/s  {theirs / ours:.2f}")


def demo(args):
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU is visible to torch"
    else:
        _validate.check_capability(torch.cuda.get_device_capability())
    _validate.check_compiler()
    if reason is None:
        _gpu_demo()
        return
    print(f"{reason}: showing what the CPU can do (compile for {args.arch}, run the CPU twin)")
    _print_compile_summary(args.arch, "bfloat16", 128, True, _config_for(args.arch, 128))
    _cpu_reference_demo()


def inspect(args):
    _validate.check_head_dims(args.head_dim, args.head_dim, args.head_dim)
    if args.dtype == "float8_e4m3fn" and args.arch not in aot.FP8_TENSOR_CORE_OP:
        raise ValueError(f"the FP8 forward needs sm_90 or newer (tileiras has no e4m3 "
                         f"matmul for {args.arch}): pass --arch sm_90, sm_100 or sm_120")
    if args.key_len is not None and args.dtype != "float8_e4m3fn":
        raise ValueError("--key-len picks among the FP8 forward's variants: pass --dtype "
                         "float8_e4m3fn (the other dtypes' variant depends on no length)")
    config = _config_for(args.arch, args.head_dim, args.tile_m, args.tile_n,
                         args.dtype == "float8_e4m3fn", args.causal, args.key_len)
    _print_compile_summary(args.arch, args.dtype, args.head_dim, args.causal, config,
                           args.sass_out, args.tile_ir_out)


BENCHMARKS = {"forward": "bench_attention.py", "features": "bench_features.py",
              "backward": "bench_backward.py", "launch": "bench_launch.py",
              "variants": "bench_variants.py", "decode": "bench_decode.py",
              "decode-variants": "bench_decode_variants.py",
              "varlen": "bench_varlen.py", "sinks": "bench_sinks.py",
              "context-parallel": "bench_context_parallel.py", "fp8": "bench_fp8.py"}


def bench(args):
    """Run one of bench/'s scripts with the remaining arguments."""
    import pathlib
    import runpy

    folder = pathlib.Path(__file__).resolve().parent.parent / "bench"
    script = folder / BENCHMARKS[args.suite]
    if not script.exists():
        raise RuntimeError(f"{script} not found: the benchmarks ship with the source tree; "
                           "clone flash_tile and install it with `pip install -e .`")
    offline = {"-h", "--help", "--replot"} & set(args.script_args)
    if not offline and not torch.cuda.is_available():
        raise RuntimeError("the benchmarks time kernels on a CUDA GPU, which torch does not see "
                           "here (`flash-tile doctor` says why); `--replot JSON` redraws "
                           "saved results without one")
    saved = sys.argv, list(sys.path)
    sys.argv = [str(script), *args.script_args]
    sys.path.insert(0, str(folder))  # the scripts import each other
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved


def tune_inputs(dtype: str, head_dim: int, length: int, args, device="cuda") -> tuple:
    """(q, k, v, varlen keyword arguments or None) of one shape of ``flash-tile tune``'s grid:
    ``args.tokens`` tokens of sequences of ``length`` rows, heads * head_dim = ``args.width``;
    [B, L, H, D] for ``flash_attn_func``, or under ``args.varlen`` the same sequences packed
    [B * L, H, D] with their ``cu_seqlens`` for ``flash_attn_varlen_func``. A varlen class is
    keyed by the packing's mean length, so any packing of that mean finds what this tuned."""
    batch, heads = _timing.grid_shape(length, head_dim, args.tokens, args.width)
    shape = (batch * length, heads, head_dim) if args.varlen else (batch, length, heads, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=_timing.DTYPES[dtype],
                           requires_grad=args.backward) for _ in range(3))
    if not args.varlen:
        return q, k, v, None
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)
    return q, k, v, {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": length,
                     "max_seqlen_k": length}


def tune(args):
    """Tune a grid of shapes into the autotune cache: each (dtype, head dim, length, causal)
    runs once through ``flash_attn_func`` (``--varlen``: ``flash_attn_varlen_func``) and,
    with ``--backward``, its backward, which tunes its problem class if the cache does not
    have it yet. Returns nothing: every failure raises."""
    import flash_tile

    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU and torch with CUDA; `flash-tile doctor` "
                           "says what is missing")
    if not autotune.enabled():
        raise RuntimeError(f"{autotune.ENV_SWITCH} turns tuning off here; unset it to tune")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    grid = [(dt, d, n, c) for dt in args.dtypes for d in args.head_dims for n in args.lengths
            for c in causals]
    bar = tqdm(grid, desc="flash-tile tune", unit="shape")
    for dtype, head_dim, length, causal in bar:
        q, k, v, packing = tune_inputs(dtype, head_dim, length, args)
        batch = q.shape[0] if packing is None else packing["cu_seqlens_q"].numel() - 1
        bar.set_postfix_str(f"{dtype} D={head_dim} L={length} causal={causal} "
                            f"({'packed ' if packing else ''}B={batch}, H={q.shape[-2]})")
        if packing is None:
            out = flash_tile.flash_attn_func(q, k, v, causal=causal)
        else:
            out = flash_tile.flash_attn_varlen_func(q, k, v, causal=causal, **packing)
        if args.backward:
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    path, entries = autotune.cached_entries(torch.device("cuda"))
    print(f"tuned {len(grid)} shapes; the winners, in {path or 'this process only'}:")
    for key, entry in sorted(entries.items()):
        print(f"  {key}: {autotune.describe(variants.TileConfig(**entry['config']))}")


def doctor(args):
    """Print what flash_tile finds here; return the number of problems (each with its fix)."""
    problems = []
    version = _validate.package_version
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA "
          f"{torch.version.cuda or 'none: a CPU build'}), cuda-tile {version('cuda-tile')}, "
          f"flash-tile {version('flash-tile')}")
    tileiras = _validate.find_tileiras()
    if tileiras:
        release = subprocess.run([tileiras, "--version"], capture_output=True, text=True).stdout
        print(f"tileiras: {tileiras} ({release.strip().splitlines()[-2].strip()})")
    else:
        problems.append(f"tileiras not found: {_validate.INSTALL_HINT}")
    if not torch.cuda.is_available():
        why = "torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
        problems.append(f"no CUDA GPU ({why}): install a CUDA build of torch on a machine with "
                        "an NVIDIA GPU of compute capability 8.0+ and driver r580+; "
                        "`flash-tile inspect` works without one")
    else:
        driver = _validate.driver_version()
        print(f"driver: {driver or 'unknown (nvidia-smi not found)'}")
        if driver and int(driver.split(".")[0]) < 580:
            problems.append(f"driver {driver} is older than r580 (CUDA 13), which cuTile needs: "
                            "update the NVIDIA driver")
        for index in range(torch.cuda.device_count()):
            capability, name = _validate.device_properties(torch.device("cuda", index))
            print(f"cuda:{index}: {name}, {variants.arch_name(capability)}")
            if capability < _validate.MIN_CAPABILITY:
                problems.append(f"cuda:{index} ({name}) is older than sm_80: not supported")
                continue
            backward = [variants.default_backward_config(capability, plain=p)
                        for p in (True, False)]
            print(f"  default variants at D=128: forward "
                  f"{autotune.describe(variants.default_config(capability))}, backward "
                  f"{autotune.describe(backward[0])}"
                  + ("" if backward[0] == backward[1] else
                     f" ({autotune.describe(backward[1])} under dropout, softcap, ALiBi or a "
                     "mask)"))
            if autotune.enabled():
                path, entries = autotune.cached_entries(torch.device("cuda", index))
                tuned = len(entries)
                print(f"  autotuning on: {len(variants.candidates(capability))} forward "
                      f"candidates at D=128; {tuned} problem classes tuned in {path}")
            else:
                print(f"  autotuning off ({autotune.ENV_SWITCH}=0): the defaults run")
        if not problems:
            _smoke_test(problems)
    for problem in problems:
        print(f"problem: {problem}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return len(problems)


def _smoke_test(problems):
    import time

    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    start = time.perf_counter()  # includes the first compile of the default variant
    switch = os.environ.get(autotune.ENV_SWITCH)
    os.environ[autotune.ENV_SWITCH] = "0"  # a check of the defaults, not a tuning run
    try:
        report = _check_against_sdpa(q, k, v, True)
    finally:
        if switch is None:
            del os.environ[autotune.ENV_SWITCH]
        else:
            os.environ[autotune.ENV_SWITCH] = switch
    print(f"smoke test (compile + run, {time.perf_counter() - start:.1f} s): max error "
          f"{report['max_err']:.1e} vs torch's {report['max_err_torch']:.1e}: "
          f"{'ok' if report['ok'] else 'WRONG'}")
    if not report["ok"]:
        problems.append("the kernel's result does not match SDPA: please report it with this "
                        "output")


def _positive(text: str) -> int:
    """An argparse type: an int >= 1 (a zero length or tile has no meaning here)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(prog="flash-tile", description=__doc__.split("\n")[0])
    parser.add_argument("--traceback", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    arch_help = f"target architecture, one of {', '.join(variants.ARCHS)} (default sm_90)"

    p = sub.add_parser("demo", help="run the kernel against SDPA (or show the CPU side)")
    p.add_argument("--arch", default="sm_90", choices=variants.ARCHS, help=arch_help)
    p.set_defaults(func=demo)

    p = sub.add_parser("inspect", help="compile a variant for an arch and summarise its SASS")
    p.add_argument("--arch", default="sm_90", choices=variants.ARCHS, help=arch_help)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(aot.DTYPES))
    p.add_argument("--head-dim", type=int, default=128,
                   help=f"query/key (and value) head dim, 1 to {_validate.MAX_HEAD_DIM}")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tile-m", type=_positive,
                   help="query rows per program (default: the arch's)")
    p.add_argument("--tile-n", type=_positive,
                   help="key rows per K-loop step (default: the arch's)")
    p.add_argument("--key-len", type=_positive,
                   help="FP8: the variant a dense call of this many keys runs (default: a "
                        "long call's)")
    p.add_argument("--sass-out", help="write the full SASS listing to this file")
    p.add_argument("--tile-ir-out", help="write the Tile IR listing to this file")
    p.set_defaults(func=inspect)

    p = sub.add_parser("doctor", help="check this machine and run a smoke test")
    p.set_defaults(func=doctor)

    p = sub.add_parser("bench", help="run a benchmark of the source tree's bench/",
                       description="Run one of bench/'s scripts (a source checkout installed "
                                   "with `pip install -e .`; a CUDA GPU unless --replot). "
                                   "`flash-tile bench SUITE --help` lists its options.")
    p.add_argument("suite", choices=sorted(BENCHMARKS))
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the benchmark script")
    p.set_defaults(func=bench)

    p = sub.add_parser("tune", help="pre-tune a grid of shapes into the autotune cache")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(_timing.DTYPES))
    p.add_argument("--head-dims", nargs="+", type=_positive, default=[64, 128])
    p.add_argument("--lengths", nargs="+", type=_positive, default=list(_timing.GRID_LENGTHS))
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--backward", action="store_true", help="tune the backward kernels too")
    p.add_argument("--varlen", action="store_true",
                   help="tune flash_attn_varlen_func's classes (packings of each length)")
    p.add_argument("--tokens", type=_positive, default=_timing.GRID_TOKENS,
                   help="batch * length of each shape")
    p.add_argument("--width", type=_positive, default=_timing.GRID_WIDTH,
                   help="heads * head dim of each shape")
    p.set_defaults(func=tune)

    args = parser.parse_args(argv)
    try:
        return 1 if args.func(args) else 0
    except Exception as e:  # noqa: BLE001 - a command-line tool reports, --traceback shows
        if args.traceback:
            raise
        # flash_tile's own errors say what is wrong; others (a compiler's, the file system's)
        # are named by their type
        kind = "" if isinstance(e, (RuntimeError, ValueError, NotImplementedError)) else \
            f"{type(e).__name__}: "
        print(f"flash-tile: error: {kind}{e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
