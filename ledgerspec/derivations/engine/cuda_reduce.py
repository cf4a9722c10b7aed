"""The global staging buffer of PyTorch's CUDA reductions (``gpu_reduce_kernel``), in pure Python.

A reduction on CUDA (``sum``, ``mean``, ``amax``, ...) runs ``gpu_reduce_kernel``. When the inputs of one output are
split across thread blocks (``ctas_per_output > 1``), the blocks combine their partial results through a buffer in
global memory plus one semaphore per block column, both taken from the CUDA caching allocator for the launch and
released when the function returns: ``torch.cuda.max_memory_allocated`` counts them, a CPU (or fake) run has no such
buffer. This module computes their sizes from the reduction's shape and the device, as PyTorch does.

Ported from PyTorch v2.4.1 (git 38b96d3399a695e704ed39b60dac733c3fbf20e2), ``aten/src/ATen/native/cuda/Reduce.cuh``;
the line numbers are those of that file as the torch 2.4.1 wheel ships it (``torch/include/ATen/native/cuda/
Reduce.cuh``, the source header copied unchanged):

- ``div_up`` :26-28, ``last_pow2`` :30-38, ``mnt_wrapper`` (512 threads at most, 256 for complex128) :60-68;
- ``ReduceConfig`` :74-216: fields :74-99, ``set_block_dimension`` :101-110, ``split_input``/``split_output``
  :112-122, ``grid`` :128-130, ``should_block_x_reduce``/``should_global_reduce`` :132-142,
  ``global_memory_size`` :195-204, ``semaphore_size`` :206-211, ``values_per_thread`` :213-215;
- ``get_output_vec_size`` :973-996, ``setReduceConfig`` :998-1130;
- ``gpu_reduce_kernel`` :1132-1235: ``buffer = allocator.allocate(config.global_memory_size())`` and
  ``semaphores = allocator.allocate(config.semaphore_size())`` (:1204-1211) when ``should_global_reduce()``, both
  freed when the function returns (``at::DataPtr`` locals).

PyTorch 2.13 (the installed one, same path) computes the same configuration for a reduction that is not along the
fastest-moving dimension (``Case 2: vectorize along output``, the one Liger's weight gradient sums take): its
``split_across_warps`` test ``values_per_thread() >= min(block_height * 16, 256)`` is the 2.4.1 test written as one
comparison; it changed the ``Case 1`` vectorization test (``dim0 >= 128``, no ``vt0`` condition) and ROCm's values,
which this port (CUDA, 2.4.1) does not follow.

The layout a reduction gets comes from ``TensorIterator`` (``TensorIteratorBase::reorder_dimensions``, "move reduced
dimensions to the front", then fastest-moving first; ``coalesce_dimensions``): :func:`rows_layout` gives it for the
one case used here, the sum over the rows of a contiguous matrix (``x.sum(dim=0)`` of an ``(M, N)`` tensor).
``arg_t``, the accumulation type whose size the staging buffer holds, is ``float`` for float32, bfloat16 and float16
sums (``sum_functor`` and ``reduce_dispatch``, ``aten/src/ATen/native/cuda/ReduceSumProdKernel.cu``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: ``mnt_wrapper<T>::MAX_NUM_THREADS`` (:60-63): 512 threads per block (256 for complex128 only)
MAX_NUM_THREADS = 512
#: ``ReduceConfig::input_vec_size`` (:79)
INPUT_VEC_SIZE = 4
#: the ``vt0`` template default of ``gpu_reduce_kernel`` (:1132)
VT0 = 4
#: ``constexpr int min_values_per_thread = 16; max_values_per_thread = 256;`` (:1094-1095)
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
#: the CUDA caching allocator's alignment of a block's address (``kMinBlockSize``): what ``get_output_vec_size``
#: reads as the input's base address divides by any element size up to 128 B
BLOCK_ALIGNMENT = 512


@dataclass(frozen=True)
class CudaDevice:
    """What ``setReduceConfig`` reads of the device: ``multiProcessorCount``, ``maxThreadsPerMultiProcessor``
    (:1107-1108) and the warp size (``at::cuda::warp_size()``, :106)."""

    sm_count: int
    max_threads_per_sm: int = 2048
    warp_size: int = 32


#: NVIDIA A100 (SXM4, sm_80): 108 SMs, 2,048 threads per SM, warps of 32 (CUDA C Programming Guide, compute
#: capability 8.0)
A100 = CudaDevice(108)
#: NVIDIA H100/H200 SXM (sm_90): 132 SMs, 2,048 threads per SM
H100 = CudaDevice(132)


@dataclass(frozen=True)
class Layout:
    """A reduction's ``TensorIterator`` after reordering and coalescing: ``shape`` and the input's ``strides``
    (bytes) per dimension, the reduced dimensions first (``num_reduce_dims`` of them)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    num_reduce_dims: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def num_outputs(self) -> int:
        n = 1
        for s in self.shape[self.num_reduce_dims :]:
            n *= s
        return n


def rows_layout(rows: int, cols: int, element_size: int) -> Layout:
    """``x.sum(dim=0)`` of a contiguous ``(rows, cols)`` tensor: the reduced rows first (stride ``cols`` elements),
    then the columns (stride one element); the two do not coalesce (the output's strides, 0 and one element, do
    not chain). A single column or row is left to the caller: it coalesces to one dimension."""
    assert rows > 1 and cols > 1, (rows, cols)
    return Layout((rows, cols), (cols * element_size, element_size), 1)


def div_up(a: int, b: int) -> int:
    """:26-28"""
    return (a + b - 1) // b


def last_pow2(n: int) -> int:
    """:30-38: the largest power of two not above ``n`` (at least 1)."""
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    return max(1, n - (n >> 1))


@dataclass
class ReduceConfig:
    """``struct ReduceConfig`` (:74-216), the host side."""

    element_size_bytes: int
    num_outputs: int
    num_inputs: int
    step_input: int = 1
    step_output: int = 1
    ctas_per_output: int = 1
    input_mult: list[int] = field(default_factory=lambda: [0, 0, 0])
    output_mult: list[int] = field(default_factory=lambda: [0, 0])
    block_width: int = 0
    block_height: int = 0
    num_threads: int = 0
    vectorize_input: bool = False
    output_vec_size: int = 1

    def set_block_dimension(self, dim0: int, dim1: int, warp_size: int, max_threads: int = MAX_NUM_THREADS) -> None:
        """:101-110"""
        max_num_threads = max_threads // self.output_vec_size
        dim0_pow2 = last_pow2(dim0) if dim0 < max_num_threads else max_num_threads
        dim1_pow2 = last_pow2(dim1) if dim1 < max_num_threads else max_num_threads
        self.block_width = min(dim0_pow2, warp_size)
        self.block_height = min(dim1_pow2, max_num_threads // self.block_width)
        self.block_width = min(dim0_pow2, max_num_threads // self.block_height)
        self.num_threads = self.block_width * self.block_height

    def split_input(self, parallelism: int) -> int:
        """:112-116"""
        step = self.step_input
        self.step_input *= parallelism
        return step

    def split_output(self, parallelism: int) -> int:
        """:118-122"""
        step = self.step_output
        self.step_output *= parallelism
        return step

    def grid(self) -> tuple[int, int]:
        """:128-130"""
        return div_up(self.num_outputs // self.output_vec_size, self.step_output), self.ctas_per_output

    def should_block_x_reduce(self) -> bool:
        """:132-134"""
        return self.input_mult[0] != 0

    def should_global_reduce(self) -> bool:
        """:140-142"""
        return self.input_mult[2] != 0

    def values_per_thread(self) -> int:
        """:213-215"""
        return div_up(self.num_inputs, self.step_input)

    def global_memory_size(self) -> int:
        """:195-204: the staging buffer, bytes."""
        if not self.should_global_reduce():
            return 0
        size = self.element_size_bytes * self.num_outputs * self.ctas_per_output
        if not self.should_block_x_reduce():
            size *= self.block_width * self.output_vec_size
        return size

    def semaphore_size(self) -> int:
        """:206-211: one ``int`` per block column, bytes."""
        if not self.should_global_reduce():
            return 0
        return 4 * self.grid()[0]


def get_output_vec_size(layout: Layout, scalar_size: int) -> int:
    """``get_output_vec_size`` (:973-996): 4, halved until it divides the input's base address (in elements; a
    caching-allocator block, :data:`BLOCK_ALIGNMENT`-aligned), the first output dimension's size and the input's
    other strides (in elements)."""
    vec_size = 4

    def update(n: int) -> None:
        nonlocal vec_size
        while n % vec_size != 0:
            vec_size //= 2

    update(BLOCK_ALIGNMENT // scalar_size)  # base address / sizeof(scalar_t): a multiple of this
    output_index = layout.num_reduce_dims
    update(layout.shape[output_index])
    for j, stride in enumerate(layout.strides):
        if j != output_index:
            update(stride // scalar_size)
    return vec_size


def set_reduce_config(
    layout: Layout, device: CudaDevice, arg_size: int, scalar_size: int, vt0: int = VT0
) -> ReduceConfig:
    """``setReduceConfig<arg_t, scalar_t, vt0>`` (:998-1130) for a layout of at least one dimension."""
    num_outputs = layout.num_outputs
    inputs_per_output = layout.numel // num_outputs
    config = ReduceConfig(arg_size, num_outputs, inputs_per_output)  # :1002-1006
    ndim, nred, strides = len(layout.shape), layout.num_reduce_dims, layout.strides
    assert ndim > 0
    # :1018-1021
    fastest = nred == ndim or strides[0] < strides[nred]
    if fastest:  # :1028-1034
        dim0, dim1, fastest_moving_stride = inputs_per_output, num_outputs, strides[0]
    else:  # :1035-1041
        dim0, dim1, fastest_moving_stride = num_outputs, inputs_per_output, strides[nred]
    if fastest_moving_stride == scalar_size:  # :1064-1075
        if fastest and dim0 > 128 and nred == 1 and vt0 >= INPUT_VEC_SIZE:  # Case 1: vectorize along input
            config.vectorize_input = True
            dim0 //= INPUT_VEC_SIZE
        elif not fastest:  # Case 2: vectorize along output
            config.output_vec_size = get_output_vec_size(layout, scalar_size)
            dim0 //= config.output_vec_size
    config.set_block_dimension(dim0, dim1, device.warp_size)  # :1079
    block_width, block_height = config.block_width, config.block_height
    if fastest:  # :1084-1092 (``iter.ndim() == 0`` is excluded above)
        config.input_mult[0] = config.split_input(block_width)
    else:
        config.output_mult[0] = config.split_output(block_width)
    # :1097-1105
    if config.values_per_thread() >= block_height * 16 or config.values_per_thread() >= MAX_VALUES_PER_THREAD:
        config.input_mult[1] = config.split_input(block_height)
    else:
        config.output_mult[1] = config.split_output(block_height)
    blocks_per_sm = device.max_threads_per_sm // config.num_threads  # :1107
    target_grid_size = device.sm_count * blocks_per_sm  # :1108-1109
    grid = config.grid()[0]  # :1110
    # :1111-1128
    if config.input_mult[1] != 0 and config.values_per_thread() >= MAX_VALUES_PER_THREAD and grid <= target_grid_size:
        ctas_per_output1 = div_up(target_grid_size, grid)
        ctas_per_output2 = div_up(config.values_per_thread(), MIN_VALUES_PER_THREAD)
        ctas_per_output3 = div_up(config.values_per_thread(), MAX_VALUES_PER_THREAD)
        config.ctas_per_output = max(min(ctas_per_output1, ctas_per_output2), ctas_per_output3)
        if config.ctas_per_output > 1:
            config.input_mult[2] = config.split_input(config.ctas_per_output)
    return config


@dataclass(frozen=True)
class Staging:
    """What one reduction takes from the caching allocator besides its output: the staging buffer and the
    semaphores, bytes as requested (the allocator rounds each to its 512-byte blocks)."""

    buffer: int
    semaphores: int

    @property
    def total(self) -> int:
        return self.buffer + self.semaphores


def staging(layout: Layout, device: CudaDevice, arg_size: int, scalar_size: int) -> Staging:
    """The staging buffer and semaphores ``gpu_reduce_kernel`` allocates for ``layout`` (:1204-1211)."""
    config = set_reduce_config(layout, device, arg_size, scalar_size)
    return Staging(config.global_memory_size(), config.semaphore_size())


#: the accumulation type's size of a sum (``arg_t``: float for float32, bfloat16 and float16 inputs), by input dtype
SUM_ARG_SIZE = {"float32": 4, "bfloat16": 4, "float16": 4, "float64": 8}
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def rows_sum_staging(rows: int, cols: int, dtype: str, device: CudaDevice) -> Staging:
    """The staging of ``x.sum(dim=0)`` for a contiguous ``(rows, cols)`` tensor of ``dtype`` (a name such as
    ``float32``) on ``device``; none for one row or one column (not the layout :func:`rows_layout` describes, and
    not one this module follows)."""
    if rows <= 1 or cols <= 1:
        return Staging(0, 0)
    size = ELEMENT_SIZE[dtype]
    return staging(rows_layout(rows, cols, size), device, SUM_ARG_SIZE[dtype], size)


__all__ = [
    "A100",
    "H100",
    "CudaDevice",
    "Layout",
    "ReduceConfig",
    "Staging",
    "rows_layout",
    "rows_sum_staging",
    "set_reduce_config",
    "staging",
]
