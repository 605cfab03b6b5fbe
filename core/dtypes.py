"""Element types, named as safetensors names them (``F32``, ``BF16``, ``I64`` ...).

Facts: the safetensors format spec (dtype strings) and safetensors/torch.py ``_TYPES`` (the
names safetensors 0.8 writes and reads back: ``F8_E4M3``, ``F8_E5M2``, ``F8_E4M3FNUZ``,
``F8_E5M2FNUZ``, ``U16``/``U32``/``U64``, ``C64``; it writes ``F8_E8M0`` and ``F4`` but its
torch loader cannot read them, so they are not listed and such tensors are refused by name);
torch's storage class names (``torch.FloatStorage`` ...) and dtype attribute names
(``torch.float32``) as they appear in ``torch.save`` pickles (read from real files written by
torch 2.13). torch/storage.py ``_new_dtypes()`` lists the dtypes pickled as an
``UntypedStorage`` plus a ``torch.<dtype>`` through ``torch._utils._rebuild_tensor_v3``
(float8 kinds, uint16/32/64, complex32 ...); the others use a typed ``<Name>Storage`` class.
"""

from __future__ import annotations

#: bytes per element
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1,
    "C64": 8, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}

FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ",
                      "F8_E5M2FNUZ"})

#: floating types that ``--dtype`` casts; float8 tensors (scaled, quantised values, often
#: with a separate scale tensor) are kept as stored, like integers and booleans
CASTABLE = frozenset({"F64", "F32", "F16", "BF16"})

#: ``torch.<name>`` dtype attribute -> safetensors name
TORCH_DTYPE_NAMES: dict[str, str] = {
    "float64": "F64", "double": "F64", "float32": "F32", "float": "F32", "float16": "F16",
    "half": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ", "int64": "I64", "long": "I64", "int32": "I32", "int": "I32", "int16": "I16", "short": "I16",
    "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "bool": "BOOL", "complex64": "C64", "cfloat": "C64",
}

#: ``torch.<name>`` dtypes a checkpoint may hold that have no safetensors name safetensors can
#: read back; a tensor of one of these is refused naming its dtype
UNSUPPORTED_TORCH_DTYPES = frozenset({
    "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32", "chalf", "complex128", "cdouble",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "qint8", "qint32", "quint8",
    "quint4x2", "quint2x4", *(f"int{i}" for i in range(1, 8)), *(f"uint{i}" for i in range(1, 8)),
})

#: ``torch.<Name>Storage`` class in a ``torch.save`` pickle -> safetensors name
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "Float8_e4m3fnStorage": "F8_E4M3",
    "Float8_e5m2Storage": "F8_E5M2", "ComplexFloatStorage": "C64", "UntypedStorage": "U8",
}

#: user-facing names for ``--dtype``
USER_DTYPES: dict[str, str] = {
    "bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "half": "F16",
    "fp32": "F32", "float32": "F32", "float": "F32",
}


def torch_dtype(name: str):
    """The ``torch.dtype`` for a safetensors dtype name (imports torch)."""
    import torch

    return {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "I64": torch.int64,
        "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
        "C64": torch.complex64,
    }[name]


def from_torch_dtype(dtype) -> str:
    """The safetensors name of a ``torch.dtype``."""
    return TORCH_DTYPE_NAMES[str(dtype).removeprefix("torch.")]
