"""sm_90 SASS (instructions, tensor-core ops, TMA loads, barriers, LDL/STL, registers) of the
paged forward (bf16, D 128, 256- / 64- / 16-key pages, causal and not) and of the split
decode's paged step: the tree before PAGE_AHEAD (argv[1]), the page-number prefetch
candidate that was timed (argv[2]) and this tree, all compiled without a GPU.

    mkdir -p /tmp/abx/head /tmp/abx/pf
    git archive 733750e flash_tile kernels | tar -x -C /tmp/abx/head
    git archive 733750e flash_tile kernels | tar -x -C /tmp/abx/pf
    E=$PWD/docs/experiments/evidence
    (cd /tmp/abx/pf && patch -p1 < $E/2026-12-07-page-prefetch-candidate.patch)
    python docs/experiments/evidence/2026-12-07-page-ahead-sass.py /tmp/abx/head /tmp/abx/pf
"""
import importlib
import sys

sys.path.insert(0, "bench")
from bench_launch import load_package  # noqa: E402

load_package(sys.argv[1], "ft_before")
load_package(sys.argv[2], "ft_candidate")
trees = {"before": importlib.import_module("ft_before.aot"),
         "candidate": importlib.import_module("ft_candidate.aot"),
         "this": importlib.import_module("flash_tile.aot")}


def summary(binary, aot):
    s = aot.summarize(aot.disassemble(binary))
    return (s["instructions"], s["tensor_core"], s["tma_load"], s["barrier"],
            s["local_memory"], aot.resource_usage(binary)["registers"])


for page in (256, 64, 16):
    for causal in (False, True):
        case = dict(dtype="bfloat16", head_dim=128, causal=causal, varlen=True, page_size=page)
        for name, aot in trees.items():
            print("forward", page, causal, name, summary(aot.compile_forward("sm_90", **case), aot),
                  flush=True)
for page in (16, 64):
    for name, aot in trees.items():
        print("decode", page, name,
              summary(aot.compile_decode("sm_90", page_size=page, splits=2)["decode"], aot),
              flush=True)
