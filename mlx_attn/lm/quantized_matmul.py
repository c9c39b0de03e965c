"""How a quantized layer multiplies: per device and per number of rows.

MLX's quantized matmul on the CPU costs about the same per row whatever the
number of rows (a 512-row prompt chunk costs ~512 single rows), while a
float32 matrix product through an optimised BLAS gains from every extra row.
So on the CPU, from ``DEQUANTIZED_MATMUL_ROWS`` rows on, a quantized layer
dequantizes its weight (a transient the size of one layer, in slices of at
most ``DEQUANTIZED_SLICE_ROWS`` output rows) and multiplies in float32:
measured here with the system OpenBLAS (``mlx_attn.use_system_blas()``)
against MLX's kernel, 20x faster at 512 rows. Fewer rows (decode, a few
requests' decode steps) go through mlx_attn's fused CPU matrix-vector
product (``_ext.quantized_matvec``, csrc/cpu/matvec_impl.h): it reads the
packed 4 or 8 bits per weight once for up to 8 rows, dequantizes in
registers and computes each row alike whatever the other rows. Measured on
every quantized layer of SmolLM2-135M (4-bit, with the float32 weights
held: the BLAS side at its best), all of one token's matmuls: 1 row 68 ms
fused against 271 ms in float32, 16 rows 166 against 198, 24 rows 327
against 371, 32 rows 484 against 341; MLX's own kernel costs about what
the float32 product does at one row and grows with every row.
Both CPU paths compute with the same float32 weights, ``scale * code +
bias``. Other bit widths and modes keep MLX's kernel. On a GPU MLX's
quantized kernels are the fast path at every row count, so nothing changes
there. The stored weights stay quantized either way; a caller that decodes
many rows often (the serving engine) may also hold each layer's float32
weight (:func:`hold_float32_weights`) instead of dequantizing it per call.

Few rows multiply in one of three ways (``MATVEC_PRODUCT``, or the
``MLX_ATTN_MATVEC`` environment variable at import). ``"int16"`` (the
default) and ``"int8"`` quantize each activation row per block of 32 columns
and multiply the packed codes as integers (``_ext.quantized_matvec_int8``,
csrc/cpu/int8_matvec_impl.h: AVX512-VNNI ``vpdpwssd`` / ``vpdpbusd``, AVX2
``vpmaddwd`` / ``vpmaddubsw``, or plain C++, chosen at run time); only the
activations are rounded, so each output is within
``sum_k |scale * code| * d_b / 2`` of the float product (``d_b`` = the
largest ``|x|`` of the column's block / 32767 or / 127;
``int8_error_bound``). int8 is llama.cpp's q8 scheme, but SmolLM2's
activations are spiky (a block's largest ``|x|`` is 10-30x its mean): int8
moves its logits by up to ~3 (greedy tokens change at near-ties and the
transformers reference tests fail), int16 by at most ~0.03, for 10-30% more
CPU time at one row and 0.75x int8's at 8 rows (its AVX512-VNNI copy's
16-output tiles; measured on SmolLM2's layers, load 13-18). ``"float"``
is the float32 product above (``_ext.quantized_matvec``). With an integer product, rows
below ``INTEGER_MATVEC_ROWS`` (2049) take it, not ``DEQUANTIZED_MATMUL_ROWS``
(24): on AVX512-VNNI its int16 copy puts 16 outputs in the lanes and reads
each weight block once for up to 128 rows, 2.5-5.3x faster than the BLAS on a
held float32 weight at every row count measured (64 to 2048), so a serving
engine need not hold one (``mlx_attn.serve.paged_forward.prepare_weights``,
``"packed"``) and prompt chunks take it too.

Projections that read the same activations (a Llama layer's Q/K/V, its
gate/up) multiply in one call (:func:`fused_matvecs`,
``_ext.quantized_matvec_int8_many``): the row is quantized once and all
weights' outputs go to the threads in one pass, the results bit-identical
to one call per weight. The weights stay separate (no concatenated copy).
The same call takes the layer's RMSNorm before the product, and
(:func:`fused_product`) a SwiGLU's ``silu(gate) * up`` before it and the
residual stream's add after it, so a decode step's graph holds one node
per product and none for the norms, activations and residual adds.

``benchmarks/bench_generate.py`` and ``benchmarks/bench_gemma3.py`` measure
the effect on prompt speed; ``benchmarks/bench_int8_matvec.py`` the integer
products against the float one.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

__all__ = ["DEQUANTIZED_MATMUL_ROWS", "DEQUANTIZED_SLICE_ROWS", "FUSED_MATVEC_BITS", "FUSED_MATVEC_GROUP_SIZES",
           "RowAdaptiveQuantizedLinear", "RowAdaptiveQuantizedEmbedding", "use_row_adaptive_matmuls",
           "hold_float32_weights", "float32_weight", "MATVEC_PRODUCTS", "MATVEC_PRODUCT", "int8_error_bound",
           "INTEGER_MATVEC_ROWS", "PASSED_MATVEC_ROWS", "matvec_rows_limit", "fused_matvecs", "fusable_norm",
           "product_reads", "fused_product", "WIDENED_BITS", "widen_for_integer_product", "stored_bits", "stored_form"]

# rows from which the CPU multiplies a dequantized float32 weight
DEQUANTIZED_MATMUL_ROWS = 24  # the crossover measured above lies between 24 and 32
# output rows of a weight dequantized at once: bounds the transient (an output head of 262,144 x 640
# would otherwise be 671 MB of float32 at once)
DEQUANTIZED_SLICE_ROWS = 16384


# how few rows multiply on the CPU: integer dot products on int16 or int8 activations, or float32
MATVEC_PRODUCTS = ("int16", "int8", "float")
MATVEC_PRODUCT = os.environ.get("MLX_ATTN_MATVEC", "int16")
if MATVEC_PRODUCT not in MATVEC_PRODUCTS:
    raise ValueError(f"MLX_ATTN_MATVEC must be one of {', '.join(MATVEC_PRODUCTS)}, got {MATVEC_PRODUCT!r}")
# columns per int8 activation block (csrc/cpu/int8_matvec_kernels.h)
INT8_BLOCK = 32
# rows from which the CPU multiplies a dequantized float32 weight when few rows take an integer
# product: measured on all of SmolLM2's layers (system OpenBLAS, 2 cores, one token's products,
# alternating, load average 13-18), the int16 product with 16 outputs in the lanes took
# 0.19-0.40x the time of the BLAS on a held float32 weight and 0.12-0.38x that of dequantizing
# per call and the BLAS at 64, 128, 256, 512, 1024 and 2048 rows; so every row count measured,
# up to a whole default prompt chunk (generate.DEFAULT_PREFILL_CHUNK, 2048), takes the integer
# product. That is the AVX512-VNNI int16 copy's figure; the other copies (AVX2, plain C++, the int8
# activations') multiply 8 rows a pass and were measured faster than the BLAS up to 64 rows and
# level at 128 (q_proj 1.23 against 1.39 ms at 64, 2.58 against 2.68 at 128): they stop there
INTEGER_MATVEC_ROWS = 2049
PASSED_MATVEC_ROWS = 128

# weights the fused CPU matrix-vector product reads (affine mode)
FUSED_MATVEC_BITS = (4, 8)
FUSED_MATVEC_GROUP_SIZES = (32, 64, 128)
# bit widths the fused products do not read, and the width a CPU model holds
# them at instead (widen_for_integer_product): the same codes, two or three
# bits more per weight, against MLX's CPU kernel at 3x the time per token
# (Gemma 3 270M's Q4_K_M GGUF, 5-bit Q5_0 layers: ~100 -> ~45 ms a token)
WIDENED_BITS = {2: 4, 3: 4, 5: 8, 6: 8}
# weights unpacked at once while widening or narrowing (bounds the transient)
WIDEN_CHUNK_WEIGHTS = 1 << 22
# bit widths _ext.dequantize_affine unpacks in one pass (MLX's own CPU
# dequantize of 3, 5 and 6 bits holds several float32 copies of the weight:
# 5x its output at 5 bits, 2x at 4, measured)
ONE_PASS_DEQUANTIZE_BITS = (2, 3, 4, 5, 6, 8)


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


def matvec_rows_limit(product: str | None = None) -> int:
    """Rows from which the CPU takes the dequantized float32 product, for
    ``product`` (default ``MATVEC_PRODUCT``) on this CPU's integer copy."""
    product = MATVEC_PRODUCT if product is None else product
    if product == "float":
        return DEQUANTIZED_MATMUL_ROWS
    from mlx_attn import _native  # noqa: PLC0415 (the extension loads once, on first use)

    tiled = product == "int16" and _native.ext is not None and _native.ext.int8_matvec_copy() == "avx512vnni"
    return INTEGER_MATVEC_ROWS if tiled else PASSED_MATVEC_ROWS



def _dequantized_rows(x: mx.array, layer) -> bool:
    return (getattr(layer, "_dequantize_many_rows", True) and _rows(x) >= matvec_rows_limit()
            and mx.default_device() == mx.cpu)


def _cpu_affine(layer, bits: tuple) -> bool:
    """Whether the extension's CPU code reads ``layer``'s packing: on the CPU,
    affine mode with biases, one of ``bits`` and a group size it unpacks."""
    return (mx.default_device() == mx.cpu and getattr(layer, "mode", "affine") == "affine"
            and layer.get("biases") is not None and layer.bits in bits
            and layer.group_size in FUSED_MATVEC_GROUP_SIZES)


def product_reads(layer) -> bool:
    """Whether the extension's fused CPU products read ``layer``'s packing
    (they convert its scales and biases to float32 themselves, exactly)."""
    return _cpu_affine(layer, FUSED_MATVEC_BITS)


def _fused_matvec_rows(x: mx.array, layer) -> bool:
    few_rows = _rows(x) < matvec_rows_limit() or not getattr(layer, "_dequantize_many_rows", True)
    return 0 < _rows(x) and few_rows and product_reads(layer)


def fused_matvec(x: mx.array, layer) -> mx.array:
    """``x @ W.T`` for a few rows through ``_ext.quantized_matvec_int8`` (int16
    or int8 activations) or ``_ext.quantized_matvec`` (``MATVEC_PRODUCT``), in
    ``x``'s dtype."""
    from mlx_attn import _ext

    if MATVEC_PRODUCT not in MATVEC_PRODUCTS:
        raise ValueError(f"MATVEC_PRODUCT must be one of {', '.join(MATVEC_PRODUCTS)}, got {MATVEC_PRODUCT!r}")
    weight = (layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)
    if MATVEC_PRODUCT == "float":
        rows = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        out = _ext.quantized_matvec(rows, *weight)
        return out.reshape(*x.shape[:-1], out.shape[-1]).astype(x.dtype)
    # the integer product takes x [..., k] as it is (no reshape nodes in a step's graph)
    x2 = x if x.ndim >= 2 else x.reshape(1, -1)
    out = _ext.quantized_matvec_int8(x2.astype(mx.float32), *weight, 16 if MATVEC_PRODUCT == "int16" else 8)
    return out.reshape(*x.shape[:-1], out.shape[-1]).astype(x.dtype) if x.ndim < 2 else out.astype(x.dtype)


def fusable_norm(norm) -> bool:
    """Whether :func:`fused_matvecs` applies ``norm`` in its own pass: a plain
    ``nn.RMSNorm`` with a float32 weight (the product normalizes in float32)."""
    return type(norm) is nn.RMSNorm and "weight" in norm and norm["weight"].dtype == mx.float32


def fused_matvecs(x: mx.array, layers: list, norm=None) -> list | None:
    """``[layer(x) for layer in layers]`` in one ``_ext.quantized_matvec_int8_many``
    call (x quantized once, one pass over the threads for all weights: a
    layer's Q/K/V or gate/up projections), or None where that does not apply:
    a float product, too many rows, a layer the integer product does not read
    or layers of different bit widths or group sizes. ``norm``: an RMSNorm the
    layers take ``norm(x)`` through, computed inside the call (no graph
    nodes of its own in a decode step); None is also returned when it is not
    :func:`fusable_norm`, and the caller then applies it itself."""
    if MATVEC_PRODUCT == "float" or not layers or (norm is not None and not fusable_norm(norm)):
        return None
    first = layers[0]
    if not all(isinstance(layer, RowAdaptiveQuantizedLinear) and _fused_matvec_rows(x, layer)
               and layer.bits == first.bits and layer.group_size == first.group_size for layer in layers):
        return None
    from mlx_attn import _ext

    rows = (x if x.ndim >= 2 else x.reshape(1, -1)).astype(mx.float32)
    norm_options = {} if norm is None else {"norm_weight": norm["weight"], "norm_eps": norm.eps}
    outs = _ext.quantized_matvec_int8_many(rows, [layer["weight"] for layer in layers],
                                           [layer["scales"] for layer in layers],
                                           [layer["biases"] for layer in layers], first.group_size, first.bits,
                                           16 if MATVEC_PRODUCT == "int16" else 8, **norm_options)
    # the dtype the layers would see: norm(x) is float32 (a float32 norm weight promotes x's dtype)
    dtype = x.dtype if norm is None else mx.float32
    results = []
    for layer, out in zip(layers, outs):
        y = (out if x.ndim >= 2 else out.reshape(-1)).astype(dtype)
        results.append(y + layer["bias"] if "bias" in layer else y)
    return results


def int8_error_bound(x, weight, activation_bits: int = 8) -> "np.ndarray":
    """The largest ``|integer product - float product|`` the integer
    matrix-vector product may give, per output, for float rows ``x`` [rows,
    k] and the dequantized weight's ``|scale * code|`` [n, k] (``weight``;
    NumPy or MLX): rounding x to ``activation_bits`` per 32-column block
    moves each value by at most d / 2, d = the block's largest |x| / 127
    (8 bits) or / 32767 (16 bits). Float32 rounding of the sums comes on
    top (relative ~1e-6 of ``|x| @ |W|.T``)."""
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    weight = np.abs(np.asarray(weight, dtype=np.float64))
    blocks = x.reshape(x.shape[0], -1, INT8_BLOCK)
    largest_code = {8: 127, 16: 32767}[activation_bits]
    half_step = np.abs(blocks).max(axis=-1, keepdims=True) / largest_code / 2
    return np.broadcast_to(half_step, blocks.shape).reshape(x.shape) @ weight.T


class _Held:
    """An array kept beside a module's parameters, not among them (not saved,
    not trained)."""

    def __init__(self, array: mx.array):
        self.array = array


def _dequantized(layer, begin: int = 0, end: int | None = None, after: mx.array | None = None) -> mx.array:
    """Output rows [begin, end) of ``layer``'s weight in float32: scale * code
    + bias in float32 (dequantizing in the scales' own half dtype would round
    every weight once more). On the CPU through ``_ext.dequantize_affine``:
    one fused multiply-add per weight, as the fused matrix-vector product
    computes it, and no intermediates.
    ``after``: an array the dequantization must wait for. MLX schedules a
    branch that needs no activations early, so without it a forward pass
    holds many layers' dequantized weights at once (measured on Gemma 3
    270M, a 127-token prefill: peak memory over the weights 96 MB without,
    83 MB with; 16 MB through MLX's quantized kernel)."""
    weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    end = weight.shape[0] if end is None else end
    codes = weight[begin:end] if after is None else mx.depends(weight[begin:end], after)
    if _cpu_affine(layer, ONE_PASS_DEQUANTIZE_BITS):
        from mlx_attn import _ext

        return _ext.dequantize_affine(codes, scales[begin:end], biases[begin:end], layer.group_size, layer.bits)
    return mx.dequantize(codes, scales[begin:end].astype(mx.float32),
                         None if biases is None else biases[begin:end].astype(mx.float32),
                         group_size=layer.group_size, bits=layer.bits, mode=layer.mode)


def float32_weight(layer) -> mx.array | None:
    """The float32 weight ``hold_float32_weights`` gave ``layer``, if any."""
    held = getattr(layer, "_float32_weight", None)
    return None if held is None else held.array


def dequantized_matmul(x: mx.array, layer) -> mx.array:
    """``x @ W.T`` for the quantized weight of ``layer`` (a quantized linear or
    embedding), through float32 slices of at most ``DEQUANTIZED_SLICE_ROWS``
    output rows, in ``x``'s dtype."""
    x32 = x.astype(mx.float32)
    held = float32_weight(layer)
    if held is not None:
        return (x32 @ held.T).astype(x.dtype)
    outputs = [x32 @ _dequantized(layer, begin, begin + DEQUANTIZED_SLICE_ROWS, after=x32).T
               for begin in range(0, layer["weight"].shape[0], DEQUANTIZED_SLICE_ROWS)]
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=-1)
    return out.astype(x.dtype)


class RowAdaptiveQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` that multiplies many rows on the CPU through a
    dequantized float32 weight (see the module)."""

    def __call__(self, x):
        if _dequantized_rows(x, self):
            y = dequantized_matmul(x, self)
        elif _fused_matvec_rows(x, self):
            y = fused_matvec(x, self)
        else:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class RowAdaptiveQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied output head)
    multiplies many rows on the CPU through dequantized float32 slices."""

    def as_linear(self, x):
        if _dequantized_rows(x, self):
            return dequantized_matmul(x, self)
        if _fused_matvec_rows(x, self):
            return fused_matvec(x, self)
        return super().as_linear(x)


_ROW_ADAPTIVE = {nn.QuantizedLinear: RowAdaptiveQuantizedLinear, nn.QuantizedEmbedding: RowAdaptiveQuantizedEmbedding}


def use_row_adaptive_matmuls(model: nn.Module, dequantize_many_rows: bool = True) -> nn.Module:
    """Give every quantized linear and embedding layer of ``model`` the
    row-adaptive multiply (in place; same weights, same state).
    ``dequantize_many_rows=False`` keeps every row count on the fused
    product where it reads the layer (the engine's ``"packed"`` weights):
    dequantizing per call costs a layer-sized transient each time and, without
    an optimised BLAS, a netlib sgemm (measured on SmolLM2, a 228-token
    engine prefill: 2.1-2.3 s through the integer product at any row count
    against 2.2-7.6 s dequantizing with the system OpenBLAS and ~30 s
    without it)."""
    for _, module in model.named_modules():
        adaptive = _ROW_ADAPTIVE.get(type(module))
        if adaptive is not None:
            module.__class__ = adaptive
        if type(module) in _ROW_ADAPTIVE.values():  # also a layer made adaptive before (at load)
            module._dequantize_many_rows = dequantize_many_rows
    return model


def hold_float32_weights(model: nn.Module) -> nn.Module:
    """Make every quantized layer of ``model`` row-adaptive and hold its
    float32 weight beside the quantized one (in place): many rows then
    multiply the held weight (no dequantization per call), few rows still
    read the packed weight. Costs 32 bits per weight of memory more."""
    use_row_adaptive_matmuls(model)
    for _, module in model.named_modules():
        if isinstance(module, tuple(_ROW_ADAPTIVE.values())):
            module._float32_weight = _Held(_dequantized(module))
            mx.eval(module._float32_weight.array)
    return model


def fused_product(x: mx.array, layer, gate: mx.array | None = None, residual: mx.array | None = None
                  ) -> mx.array | None:
    """``residual + layer(silu(gate) * x)`` (each part where given) as one
    ``_ext.quantized_matvec_int8_many`` call: the SwiGLU computed where the
    activations are quantized, the add where the outputs are written. None
    where that does not apply (a float product, too many rows, a layer the
    integer product does not read or with a bias, arrays that are not all
    float32 of matching shapes); the caller then computes it unfused. The
    SwiGLU's sigmoid uses the kernels' exp (relative error ~3e-7 against
    MLX's, well inside the activations' int16 rounding); the add is float32's."""
    if MATVEC_PRODUCT == "float" or not isinstance(layer, RowAdaptiveQuantizedLinear) or "bias" in layer:
        return None
    if x.ndim < 2 or x.dtype != mx.float32 or not _fused_matvec_rows(x, layer):
        return None
    if gate is not None and (gate.dtype != mx.float32 or gate.shape != x.shape):
        return None
    out_shape = (*x.shape[:-1], layer["weight"].shape[0])
    if residual is not None and (residual.dtype != mx.float32 or tuple(residual.shape) != out_shape):
        return None
    from mlx_attn import _ext

    return _ext.quantized_matvec_int8_many(x, [layer["weight"]], [layer["scales"]], [layer["biases"]],
                                           layer.group_size, layer.bits, 16 if MATVEC_PRODUCT == "int16" else 8,
                                           gate=gate, residual=residual)[0]


def _row_chunks(rows: int, k: int):
    step = max(1, WIDEN_CHUNK_WEIGHTS // max(1, k))
    return [(begin, min(rows, begin + step)) for begin in range(0, rows, step)]


def _widened_codes(layer, bits: int) -> mx.array:
    """``layer``'s codes re-packed at ``bits`` (4 or 8), chunk by chunk."""
    from mlx_attn import _ext

    weight, scales = layer["weight"], layer["scales"]
    rows, k = weight.shape[0], scales.shape[-1] * layer.group_size
    parts = []
    for begin, end in _row_chunks(rows, k):
        ones = mx.ones(scales[begin:end].shape, mx.float32)
        codes = _ext.dequantize_affine(weight[begin:end], ones, mx.zeros_like(ones), layer.group_size,
                                       layer.bits).astype(mx.uint8)  # scale 1, bias 0: the codes, exactly
        if bits == 4:  # two codes a byte, the even column in the low nibble (a little-endian bit stream)
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        parts.append(mx.view(codes, mx.uint32))
        mx.eval(parts[-1])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def widen_for_integer_product(model: nn.Module) -> int:
    """On the CPU, hold every quantized layer of ``model`` whose bit width the
    fused products do not read (``WIDENED_BITS``: 2, 3, 5, 6) at the next
    width they do (4 or 8), in place: the same codes, scales and biases, so
    the same weights and outputs, through the integer product instead of
    MLX's CPU kernel. The layer remembers its stored width
    (:func:`stored_form`: what saving writes). Returns the layers widened;
    none off the CPU (MLX's GPU kernels read every width)."""
    if mx.default_device() != mx.cpu:
        return 0
    widened = 0
    for _, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or not _cpu_affine(
                module, tuple(WIDENED_BITS)):
            continue
        stored = module.bits
        module.weight = _widened_codes(module, WIDENED_BITS[stored])
        module.bits = WIDENED_BITS[stored]
        module._stored_bits = stored
        widened += 1
    return widened


def stored_bits(module) -> int:
    """The bit width a quantized layer's checkpoint held it at."""
    return getattr(module, "_stored_bits", None) or module.bits


def stored_form(module) -> tuple[int, mx.array]:
    """``(bits, packed codes)`` of a quantized layer as its checkpoint held
    it: a layer :func:`widen_for_integer_product` widened is narrowed back
    (exactly: its codes fit the stored width)."""
    stored = stored_bits(module)
    if stored == module.bits:
        return module.bits, module["weight"]
    import numpy as np

    weight = module["weight"]
    rows, k = weight.shape[0], weight.shape[-1] * 32 // module.bits
    row_bytes = np.array(weight).view(np.uint8).reshape(rows, -1)
    packed = np.empty((rows, k * stored // 8), np.uint8)
    for begin, end in _row_chunks(rows, k):
        stream = np.unpackbits(row_bytes[begin:end], axis=1, bitorder="little")  # code i at bits i * module.bits
        fields = stream.reshape(end - begin, k, module.bits)[:, :, :stored]
        packed[begin:end] = np.packbits(fields.reshape(end - begin, k * stored), axis=1, bitorder="little")
    return stored, mx.array(packed.view(np.uint32))
