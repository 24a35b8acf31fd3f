"""sm_90 SASS of the FP8 forward and of the paged forward (an FP8 cache's and bf16 pages'):
this tree's kernels (three [B, H_kv] descale arrays) against those of a tree before the
change (one [3, B, H_kv] stack), both compiled without a GPU. Prints, per case, (instructions,
tensor-core ops, TMA loads, barriers, LDL/STL, registers) for the old and the new kernel.

    mkdir -p ab/pre && git archive bf4810e flash_tile kernels | tar -x -C ab/pre
    python docs/experiments/evidence/2026-12-07-fp8-descale-views-sass.py ab/pre
"""
import sys

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature

sys.path.insert(0, "bench")
from bench_variants import load_kernels  # noqa: E402
from flash_tile import _launch, aot  # noqa: E402

old = load_kernels(sys.argv[1])["attention_fwd"]
cases = [dict(dtype="bfloat16", head_dim=128, causal=False, fp8=True),
         dict(dtype="bfloat16", head_dim=128, causal=True, fp8=True),
         dict(dtype="bfloat16", head_dim=256, causal=True, fp8=True, varlen=True),
         dict(dtype="bfloat16", head_dim=128, causal=True, varlen=True, page_size=64,
              kv_dtype="float8_e4m3fn"),
         dict(dtype="bfloat16", head_dim=128, causal=False, varlen=True, page_size=16,
              kv_dtype="float8_e4m3fn"),
         dict(dtype="bfloat16", head_dim=128, causal=True, varlen=True, page_size=64),
         dict(dtype="bfloat16", head_dim=128, causal=False, fp8=True, one_factor=True),
         dict(dtype="bfloat16", head_dim=128, causal=True, varlen=True, page_size=64,
              kv_dtype="float8_e4m3fn", one_factor=True)]
# One factor a tensor (per-tensor scaling, or None): a [B, H_kv] view of zero strides, which
# the JIT compiles as an instance of its own.
ONE_FACTOR = ArrayConstraint(ct.float32, 2, index_dtype=ct.int32, stride_lower_bound_incl=0,
                             alias_groups=(), may_alias_internally=True, stride_constant=(0, 0),
                             stride_divisible_by=(1, 1), shape_divisible_by=(1, 1),
                             base_addr_divisible_by=4)
for case in cases:
    config = aot._default_config("sm_90", case["head_dim"], None, fp8=case.get("fp8", False),
                                 causal=case["causal"], paged="page_size" in case)
    window = (-1, 0) if case["causal"] else (-1, -1)
    keys = dict(varlen=case.get("varlen", False), fp8=case.get("fp8", False),
                page_size=case.get("page_size"), kv_dtype=case.get("kv_dtype"))
    sig = aot.forward_signature(case["dtype"], case["head_dim"], case["head_dim"], window, False,
                                False, None, False, True, config, **keys)
    params = list(sig.parameters)
    n = _launch.FORWARD_ARRAYS.index("q_descale")
    if case.get("one_factor"):
        params[n:n + 3] = [p if p is aot.ABSENT else ONE_FACTOR for p in params[n:n + 3]]
        sig = KernelSignature(params, CallingConvention.cutile_python_v1())
    reads = params[n + 1]  # the k factors' constraint, or ABSENT
    stack = aot._array(ct.float32, 3) if reads is not aot.ABSENT else aot.ABSENT
    old_sig = KernelSignature(params[:n] + [stack] + params[n + 3:],
                              CallingConvention.cutile_python_v1())
    new_bin = aot._export(_launch.hinted_kernel(config), sig, "sm_90")
    old_bin = aot._export(old.replace_hints(**config.hints()) if config.hints() else old,
                          old_sig, "sm_90")
    row = []
    for binary in (old_bin, new_bin):
        sass = aot.disassemble(binary)
        s = aot.summarize(sass)
        row.append((s["instructions"], s["tensor_core"], s["tma_load"], s["barrier"],
                    s["local_memory"], aot.resource_usage(binary)["registers"]))
    print(case, "\n   old", row[0], "\n   new", row[1], flush=True)
