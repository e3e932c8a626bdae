"""The executor geometry the planner and both executors share (pure NumPy, no jax, no torch): the
token layout of a group (`layout`: packing, bucket padding, zigzag, pad-skipping chunks) and the
attention tiling (`tiling`: which tile pairs the ring evaluates)."""
