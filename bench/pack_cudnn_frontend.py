"""Pack cudnn-frontend's Python package for a GPU machine without network access.

bench_fp8.py times cuDNN's FP8 SDPA through ``nvidia-cudnn-frontend``. Where the GPU machine
cannot install it, this downloads the wheel for its Python (default 3.12) here, keeps the
``cudnn`` package without the subpackages the graph API does not import (their python
kernels, gemm, linear attention, ...; about 1.5 MB as .tar.xz instead of an 11.6 MB wheel)
and writes them as a .tar.xz to carry:

    python bench/pack_cudnn_frontend.py                   # .device/cudnn-frontend-cp312.tar.xz
    # on the GPU machine:
    mkdir -p /tmp/cfe && tar -C /tmp/cfe -xJf .device/cudnn-frontend-cp312.tar.xz
    PYTHONPATH=/tmp/cfe python bench/bench_fp8.py

cuDNN itself comes from torch's own wheel there (cudnn-frontend loads the libcudnn it finds).
"""

import argparse
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile

# Subpackages of ``cudnn`` that `import cudnn` and `graph.sdpa_fp8` do not need (the engine
# manifest skips a missing one).
UNUSED = ("gemm", "linear_attention", "deepseek_sparse_attention", "gated_attention_block",
          "moe_ep", "block_sparse_attention", "native_sparse_attention", "hstu", "fla", "csa",
          "engram", "gnn", "QSA", "sdpa/fwd", "sdpa/bwd", "flex_attention",
          # Also left out of the 2026-12-06 run that timed cuDNN's FP8 SDPA on an H100:
          "conv", "triangle_attention", "triangle_multiplicative_update",
          "causal_conv1d_bulk_sm100", "causal_conv1d_update_sm100", "jax", "norm", "ops", "rope",
          "rmsnorm_rht_amax", "experimental")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--version", default="", help="a cudnn-frontend version, e.g. 1.32.0")
    parser.add_argument("--out", default=None, help="default .device/cudnn-frontend-cpXY.tar.xz")
    args = parser.parse_args()
    tag = "cp" + args.python_version.replace(".", "")
    out = pathlib.Path(args.out or f".device/cudnn-frontend-{tag}.tar.xz")
    spec = "nvidia-cudnn-frontend" + (f"=={args.version}" if args.version else "")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", "--python-version", args.python_version,
                        "-d", tmp, spec], check=True)
        wheel = next(pathlib.Path(tmp).glob("*.whl"))
        unpacked = pathlib.Path(tmp, "unpacked")
        zipfile.ZipFile(wheel).extractall(unpacked)
        skipped = tuple(f"cudnn/{name}" for name in UNUSED)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz") as archive:
            archive.add(unpacked / "cudnn", arcname="cudnn",
                        filter=lambda info: None if info.name.startswith(skipped) else info)
    print(f"{wheel.name} -> {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
