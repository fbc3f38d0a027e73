"""Quantized Hugging Face checkpoints read at full precision, and FP8 written back.

config.json's ``quantization_config`` says how the weights are stored; the checkpoint itself
says which tensors are (a tensor with its scales beside it):

- block-scaled FP8, ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic"}`` (DeepSeek-V3, Kimi K2, GLM-4.5-FP8): a weight stored
  float8_e4m3fn [..., R, C] with ``{name}_scale_inv`` float32 [..., ceil(R / 128), ceil(C / 128)],
  one scale per block, the blocks at the bottom and right edges partial. The dense weight is
  ``float32(value) * scale`` cast to the dequantized dtype, as transformers' ``Fp8Dequantize``
  computes it; the edge blocks are those of transformers' FP8 matmul (``_dequantize_fp8_weight``)
  and DeepSeek's ``weight_dequant``.
- MXFP4, ``{"quant_method": "mxfp4", ...}`` (gpt-oss's experts): ``{name}_blocks`` uint8
  [E, R, G, 16] (two e2m1 values a byte, the low nibble first, 32 a block) and
  ``{name}_scales`` uint8 [E, R, G] (e8m0: the block's power of two, biased by 127) encode
  ``{name}`` [E, G * 32, R], as transformers' ``convert_moe_packed_tensors`` decodes it (the
  dense tensor transposed from the stored rows, gpt-oss's ``mlp.experts.gate_up_proj`` layout).

Both decode into config.json's dtype (bfloat16 when it names none), the dtype transformers'
``dequantize=True`` gives the model. Checkpoints are indexed with every encoded tensor and its
scales replaced by one ``DequantizedTensor`` under the dense name, read tensor by tensor like
any stored tensor (``safetensors_io.read_tensor``, ``read_rows``, ``slab``), so a quantized
checkpoint converts, loads and shards with the memory of a full-precision one.

Convert records each FP8 weight's scales in the step directory (``FP8_SCALES``); export with
``--fp8`` writes those weights back as e4m3 values and scales in the same blocks. Quantizing a
dequantized weight with its own scales gives back the stored bytes: rounding ``value * scale``
to bfloat16 (or float32) moves it by at most 2^-9 of itself, while the next e4m3 value is at
least 2^-4 of a value away (a subnormal's next one 2^-9 away, far more than the rounding moves
it), so rounding back to e4m3 returns the stored value. That holds whenever every product is
a normal number of the dequantized dtype: for bfloat16 and float32, scales above 2^-117 (the
tests check every finite e4m3 value with scales from 2^-100 to 2^21); float16, whose normal
numbers start at 2^-14, is not covered. So a weight as converted is written back bit for bit;
one the recorded scales do not give back (changed since: LoRA merged into it) gets fresh
scales, transformers' ``Fp8Quantize``: 448 / amax per block (1 for a block of zeros), edge
blocks partial.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from llmflow.models.config import ConfigError
from llmflow.weights.errors import CheckpointError
from llmflow.weights.safetensors_io import (
    StoredTensor,
    TensorSpecs,
    read_rows,
    read_safetensors_header,
    read_tensor,
    slab,
    write_safetensors,
)

QUANTIZATION_CONFIG = "quantization_config"
FP8_SCALE = "_scale_inv"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_SCALES = "fp8_scales.safetensors"
"""The file of a converted step directory holding the scales of the checkpoint's FP8 weights,
by their names in it (``model.layers.0.self_attn.q_proj.weight_scale_inv``), as stored."""
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code."""
_DEQUANTIZED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """Block-scaled float8_e4m3fn weights (``quant_method`` "fp8")."""

    block: tuple[int, int]
    """Rows and columns of a block (``weight_block_size``)."""
    power_of_two: bool = False
    """Scales are powers of two (``scale_fmt`` "ue8m0", stored as float32): fresh ones are rounded up to one."""

    def dense_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scales of a weight of ``shape``: one per block, edge blocks partial."""
        return (*shape[:-2], -(-shape[-2] // self.block[0]), -(-shape[-1] // self.block[1]))

    def check(self, name: str, values: StoredTensor, scale_name: str, scales: StoredTensor) -> None:
        if values.dtype != torch.float8_e4m3fn or len(values.shape) < 2:
            raise CheckpointError(f"{values.path}: tensor {name!r} is {values.dtype} {values.shape}; "
                                  "quantization_config fmt 'e4m3' stores float8_e4m3fn matrices")
        if scales.dtype != torch.float32 or scales.shape != self.scale_shape(values.shape):
            raise CheckpointError(f"{scales.path}: scale tensor {scale_name!r} is {scales.dtype} {scales.shape}; "
                                  f"{name!r} {values.shape} in blocks of {list(self.block)} needs float32 "
                                  f"{self.scale_shape(values.shape)}")

    def _expand(self, scales: torch.Tensor, rows: int, cols: int, first_row: int = 0) -> torch.Tensor:
        """One scale per element of ``rows`` x ``cols`` values starting ``first_row`` rows into the first block."""
        by_row = scales.repeat_interleave(self.block[0], dim=-2)[..., first_row:first_row + rows, :]
        return by_row.repeat_interleave(self.block[1], dim=-1)[..., :cols]

    def dequantize(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   first_row: int = 0) -> torch.Tensor:
        """``values`` times their blocks' ``scales``, in float32, cast to ``dtype``; ``first_row``:
        where ``values`` start in the first block row of ``scales``."""
        return (values.float() * self._expand(scales, *values.shape[-2:], first_row)).to(dtype)

    def read_rows(self, values: StoredTensor, scales: StoredTensor, start: int, stop: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` of the dense tensor (dim 0: a matrix's rows, fused experts' experts),
        reading only the values and block rows of scales they need."""
        if len(values.shape) > 2:
            return self.dequantize(read_rows(values, start, stop), read_rows(scales, start, stop), dtype)
        first_block = start // self.block[0]
        block_rows = read_rows(scales, first_block, -(-stop // self.block[0]))
        return self.dequantize(read_rows(values, start, stop), block_rows, dtype, start - first_block * self.block[0])

    def fresh_scales(self, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward scale, ``scale_inv``) of each block of ``dense`` as transformers' ``Fp8Quantize``
        computes them: 448 / amax (1 for a block of zeros) and its reciprocal, with ue8m0 the
        reciprocal rounded up to a power of two and the forward scale its reciprocal."""
        rows, cols = dense.shape[-2:]
        pad = (0, -cols % self.block[1], 0, -rows % self.block[0])
        blocks = torch.nn.functional.pad(dense.float().abs(), pad).unflatten(-1, (-1, self.block[1]))
        amax = blocks.unflatten(-3, (-1, self.block[0])).amax(dim=(-3, -1))
        forward = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
        inverse = (1.0 / forward).float()
        if self.power_of_two:
            inverse = torch.pow(2.0, torch.ceil(torch.log2(inverse.clamp(min=torch.finfo(torch.float32).tiny))))
            forward = 1.0 / inverse
        return forward, inverse

    def quantize(self, dense: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
        """The e4m3 values of ``dense`` times its blocks' ``forward`` scales (1 / ``scale_inv``),
        in float32, clamped to ±448."""
        scaled = dense.float() * self._expand(forward, *dense.shape[-2:])
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class Mxfp4:
    """MXFP4 expert weights (``quant_method`` "mxfp4")."""

    def dense_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, rows, groups, pairs = shape
        return (*lead, groups * pairs * 2, rows)

    def check(self, name: str, blocks: StoredTensor, scales_name: str, scales: StoredTensor) -> None:
        if blocks.dtype != torch.uint8 or len(blocks.shape) != 4 or blocks.shape[-1] != 16:
            raise CheckpointError(f"{blocks.path}: tensor {name!r} is {blocks.dtype} {blocks.shape}; MXFP4 blocks "
                                  "are uint8 [experts, rows, blocks, 16]")
        if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
            raise CheckpointError(f"{scales.path}: scale tensor {scales_name!r} is {scales.dtype} {scales.shape}; "
                                  f"{name!r} {blocks.shape} needs uint8 {blocks.shape[:-1]}")

    def dequantize(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dense tensor, computed as transformers' ``convert_moe_packed_tensors``: each code's
        e2m1 value in ``dtype``, ``ldexp`` by its block's exponent, the rows transposed."""
        *lead, rows, groups, pairs = blocks.shape
        lut = torch.tensor(FP4_VALUES, dtype=dtype)
        codes = blocks.reshape(-1, pairs)
        out = torch.empty(codes.shape[0], pairs * 2, dtype=dtype)
        out[:, 0::2] = lut[(codes & 0x0F).to(torch.int)]
        out[:, 1::2] = lut[(codes >> 4).to(torch.int)]
        torch.ldexp(out, scales.to(torch.int32).reshape(-1, 1) - 127, out=out)
        return out.reshape(*lead, rows, groups * pairs * 2).transpose(-2, -1).contiguous()

    def read_rows(self, blocks: StoredTensor, scales: StoredTensor, start: int, stop: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` of the dense tensor: experts alone; an expert's rows (its stored
        columns) from the whole expert."""
        if len(blocks.shape) == 4:
            return self.dequantize(read_rows(blocks, start, stop), read_rows(scales, start, stop), dtype)
        return self.dequantize(read_tensor(blocks), read_tensor(scales), dtype)[start:stop]


Scheme = Fp8Blocks | Mxfp4


@dataclasses.dataclass(frozen=True)
class DequantizedTensor:
    """A quantized checkpoint tensor with its scales, read as the dense tensor they encode;
    read as a ``StoredTensor`` is (``read_tensor``, ``read_rows``, ``slab``)."""

    values: StoredTensor
    scales: StoredTensor
    scheme: Scheme
    dtype: torch.dtype
    """The dequantized dtype."""
    rows: tuple[int, int] | None = None
    """A slab of one expert of fused experts: these rows of the expert's dense tensor."""

    @property
    def path(self) -> Path:
        return self.values.path

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.scheme.dense_shape(self.values.shape)
        return shape if self.rows is None else (self.rows[1] - self.rows[0], *shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self, rows: int | None = None) -> torch.Tensor:
        """The dense tensor; with ``rows``, zero-padded along dim 0 to that many rows."""
        tensor = self.read_rows(0, self.shape[0])
        if rows:
            tensor = torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])
        return tensor

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"{self.path}: rows [{start}, {stop}) of a tensor of {self.shape[0]} rows")
        first = self.rows[0] if self.rows is not None else 0
        return self.scheme.read_rows(self.values, self.scales, first + start, first + stop, self.dtype)

    def slab(self, index: int, start: int, stop: int) -> DequantizedTensor:
        """Rows ``[start, stop)`` of expert ``index``."""
        def expert(stored: StoredTensor) -> StoredTensor:
            return slab(stored, index, 0, stored.shape[1])

        return DequantizedTensor(expert(self.values), expert(self.scales), self.scheme, self.dtype, (start, stop))


def read_quantization(hf_config: dict[str, Any], source: str) -> Scheme | None:
    """How ``hf_config`` (config.json, named ``source`` in errors) says the weights are stored;
    None for full precision. ``ConfigError`` for what llmflow does not read."""
    quantization = hf_config.get(QUANTIZATION_CONFIG)
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise ConfigError(f"{source}: {QUANTIZATION_CONFIG} is {quantization!r}, not an object")
    method = quantization.get("quant_method")
    if method == "mxfp4":
        return Mxfp4()
    if method != "fp8":
        raise ConfigError(f"{source}: {QUANTIZATION_CONFIG}.quant_method={method!r} is not supported; llmflow "
                          "reads 'fp8' (block-scaled float8_e4m3fn) and 'mxfp4' checkpoints")
    expected = {"fmt": ("e4m3",), "activation_scheme": ("dynamic",), "scale_fmt": ("float", None, "ue8m0")}
    for key, allowed in expected.items():
        value = quantization.get(key, allowed[0])
        if value not in allowed:
            raise ConfigError(f"{source}: {QUANTIZATION_CONFIG}.{key}={value!r} is not supported for quant_method "
                              f"'fp8'; expected {' or '.join(map(repr, allowed))}")
    block = quantization.get("weight_block_size", [128, 128])
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ConfigError(f"{source}: {QUANTIZATION_CONFIG}.weight_block_size={block!r} is not supported for "
                          "quant_method 'fp8'; expected [rows, columns] of a scale's block")
    return Fp8Blocks((block[0], block[1]), power_of_two=quantization.get("scale_fmt") == "ue8m0")


def dequantized_dtype(hf_config: dict[str, Any], source: str) -> torch.dtype:
    """The dtype quantized weights decode into: config.json's (a multimodal one's text
    config's when the top level names none), bfloat16 when it names none."""
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else {}
    name = next((c[k] for c in (hf_config, text) for k in ("dtype", "torch_dtype") if c.get(k)), "bfloat16")
    if name not in _DEQUANTIZED_DTYPES:
        raise ConfigError(f"{source}: dtype={name!r}; quantized weights dequantize into one of {tuple(_DEQUANTIZED_DTYPES)}")
    return _DEQUANTIZED_DTYPES[name]


def dequantized_index(directory: Path,
                      tensors: dict[str, StoredTensor]) -> dict[str, StoredTensor | DequantizedTensor]:
    """The tensors of the checkpoint in ``directory`` (by name, from its headers) as they are
    read: each quantized tensor and its scales replaced by one ``DequantizedTensor`` under the
    dense name. Refused, before anything is read: a ``quantization_config`` llmflow does not
    read, a quantized tensor without its scales, scales without their tensor."""
    config = directory / "config.json"
    hf_config = json.loads(config.read_text()) if config.is_file() else {}
    scheme = read_quantization(hf_config, str(config))
    if scheme is None:
        return tensors
    dtype = dequantized_dtype(hf_config, str(config))
    pair = _fp8_pairs if isinstance(scheme, Fp8Blocks) else _mxfp4_pairs
    index: dict[str, StoredTensor | DequantizedTensor] = {}
    for dense, stored in pair(tensors):
        if isinstance(stored, _Encoded):
            scheme.check(stored.name, stored.values, stored.scales_name, stored.scales)
            if dense != stored.name and dense in tensors:
                raise CheckpointError(f"{stored.values.path}: {dense!r} is stored both dense and as {stored.name!r}")
            index[dense] = DequantizedTensor(stored.values, stored.scales, scheme, dtype)
        else:
            index[dense] = stored
    return index


@dataclasses.dataclass(frozen=True)
class _Encoded:
    """A quantized tensor and its scales, by their names in the checkpoint."""

    name: str
    values: StoredTensor
    scales_name: str
    scales: StoredTensor


def _fp8_pairs(tensors: dict[str, StoredTensor]) -> Iterator[tuple[str, StoredTensor | _Encoded]]:
    """(name, tensor) of each tensor stored as it is read, (name, its encoding) of each FP8 weight."""
    for name, stored in tensors.items():
        if name.endswith(FP8_SCALE):
            if name.removesuffix(FP8_SCALE) not in tensors:
                raise CheckpointError(f"{stored.path}: scale tensor {name!r} scales no tensor "
                                      f"({name.removesuffix(FP8_SCALE)!r} is not in the checkpoint)")
            continue
        scale_name = name + FP8_SCALE
        scales = tensors.get(scale_name)
        if scales is None and stored.dtype.itemsize == 1 and stored.dtype.is_floating_point:
            raise CheckpointError(f"{stored.path}: FP8 tensor {name!r} has no scale tensor {scale_name!r}")
        yield name, stored if scales is None else _Encoded(name, stored, scale_name, scales)


def _mxfp4_pairs(tensors: dict[str, StoredTensor]) -> Iterator[tuple[str, StoredTensor | _Encoded]]:
    """(name, tensor) of each tensor stored as it is read, (dense name, its encoding) of each MXFP4 tensor."""
    for name, stored in tensors.items():
        if name.endswith(MXFP4_SCALES):
            blocks_name = name.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS
            if blocks_name not in tensors:
                raise CheckpointError(f"{stored.path}: MXFP4 scales {name!r} have no blocks {blocks_name!r}")
            continue
        if not name.endswith(MXFP4_BLOCKS):
            yield name, stored
            continue
        dense = name.removesuffix(MXFP4_BLOCKS)
        scales_name = dense + MXFP4_SCALES
        if scales_name not in tensors:
            raise CheckpointError(f"{stored.path}: MXFP4 blocks {name!r} have no scale tensor {scales_name!r}")
        yield dense, _Encoded(name, stored, scales_name, tensors[scales_name])


def fp8_scales(parts: Iterable[tuple[str, StoredTensor]]) -> dict[str, StoredTensor] | None:
    """The scales of the FP8 weights among ``parts`` ((name, tensor) as indexed), by scale name;
    None when one is a slab of fused experts, which export writes one tensor per expert: its
    blocks are not that tensor's."""
    scales = {}
    for name, stored in parts:
        if isinstance(stored, DequantizedTensor) and isinstance(stored.scheme, Fp8Blocks):
            if stored.rows is not None:
                return None
            scales[name + FP8_SCALE] = stored.scales
    return scales


def write_fp8_scales(step_dir: Path, scales: dict[str, StoredTensor]) -> None:
    """``FP8_SCALES`` in ``step_dir``: ``scales`` as stored, one at a time."""
    specs = {name: (stored.dtype, stored.shape) for name, stored in scales.items()}
    write_safetensors(step_dir / FP8_SCALES, specs, (read_tensor(stored) for stored in scales.values()))


def read_fp8_scales(step_dir: Path) -> dict[str, StoredTensor]:
    """The recorded FP8 scales of a step directory (``FP8_SCALES``), none when it has no such file."""
    path = step_dir / FP8_SCALES
    return read_safetensors_header(path) if path.is_file() else {}


class Fp8Writer:
    """The tensors of an FP8 export: each weight with a recorded scale written as e4m3 values
    followed by its ``_scale_inv``, with the recorded scales when they give back the weight's
    values as converted (dequantized into ``dtype``) exactly, else with fresh ones; every other
    tensor as it is."""

    def __init__(self, scheme: Fp8Blocks, recorded: dict[str, StoredTensor], dtype: torch.dtype) -> None:
        self.scheme, self.recorded, self.dtype = scheme, recorded, dtype
        self.written: list[str] = []
        """The weights written as FP8."""
        self.fresh: list[str] = []
        """Those of them written with fresh scales."""
        self._scales: dict[str, torch.Tensor] = {}  # scales of weights written, until their turn

    def specs(self, specs: TensorSpecs) -> TensorSpecs:
        """The written tensors of a model whose tensors ``specs`` describes."""
        encoded: TensorSpecs = {}
        for name, (dtype, shape) in specs.items():
            scale_name = name + FP8_SCALE
            if scale_name not in self.recorded:
                encoded[name] = (dtype, shape)
                continue
            recorded = self.recorded[scale_name]
            if recorded.shape != self.scheme.scale_shape(shape):
                raise CheckpointError(f"{recorded.path}: scale tensor {scale_name!r} {recorded.shape} does not fit "
                                      f"{name!r} {shape} in blocks of {list(self.scheme.block)}")
            encoded[name] = (torch.float8_e4m3fn, shape)
            encoded[scale_name] = (torch.float32, recorded.shape)
        return encoded

    def reader(self, read: Callable[[list[str]], Iterable[torch.Tensor]]) -> Callable[[list[str]], Iterator[torch.Tensor]]:
        """``read`` (a shard's tensors by name, in order) for the shards of ``specs``: a weight's
        scales follow it, in its shard or at the start of the next."""

        def encoded(shard: list[str]) -> Iterator[torch.Tensor]:
            tensors = iter(read([name for name in shard if not self._is_scale(name)]))
            for name in shard:
                if self._is_scale(name):
                    yield self._scales.pop(name)
                    continue
                tensor = next(tensors)
                yield self._encode(name, tensor) if name + FP8_SCALE in self.recorded else tensor

        return encoded

    def _is_scale(self, name: str) -> bool:
        return name in self.recorded

    def _encode(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        self.written.append(name)
        scales = read_tensor(self.recorded[name + FP8_SCALE])
        values = self.scheme.quantize(dense, 1.0 / scales)
        if not torch.equal(self.scheme.dequantize(values, scales, self.dtype).to(dense.dtype), dense):
            self.fresh.append(name)
            forward, scales = self.scheme.fresh_scales(dense)
            values = self.scheme.quantize(dense, forward)
        self._scales[name + FP8_SCALE] = scales
        return values
