"""The kernel lab: what the tests and the benchmarks share to build, run and
model mlx_attn's Metal kernels without a Mac. Not part of mlx_attn (never in
its wheel); installed from the checkout with ``pip install -e ./kernel_lab``
(scripts/test.sh does).

- ``kernel_lab.msl_emulator``: type-checks Metal kernels with clang-19 and runs
  them on the CPU (docs/msl_emulator.md);
- ``kernel_lab.metal_runner``, ``paged_metal_runner``: run our kernels from
  the C++ launch plans, as the Mac host does; ``mlx_kernel_runner``: MLX's
  own attention kernels, launched as MLX's host code does;
- ``kernel_lab.decode_rule``: the decode shape and split rule, written again
  as an oracle for the plan;
- ``kernel_lab.metal_cost_model``: registers, occupancy and predicted time of
  a kernel; ``cost_checks`` and ``cost_report``: the model's checks of the
  plans and its tables; ``emulated_costs``: our kernels and MLX's in counting
  builds of the emulator; ``paged_metal_rows``: the paged kernels' rows;
- ``kernel_lab.local_ranks``: several ranks of a distributed program on this
  machine;
- ``kernel_lab.checkout``: where the checkout (its metal/ sources) is.

Modules import only what they use: importing the package loads nothing.
"""
