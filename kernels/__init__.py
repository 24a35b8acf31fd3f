"""cuTile kernel sources of flash_tile, shipped as ``flash_tile.kernels``.

Modules here import ``cuda.tile`` and ``math`` only; everything torch-facing lives in
``flash_tile``.
"""
