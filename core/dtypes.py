"""Element types, named as safetensors names them (``F32``, ``BF16``, ``I64`` ...).

Facts: the safetensors format spec (dtype strings); torch's storage class names
(``torch.FloatStorage`` ...) and dtype attribute names (``torch.float32``) as they appear in
``torch.save`` pickles (read from real files written by torch 2.13).
"""

from __future__ import annotations

#: bytes per element
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1,
    "C64": 8,
}

FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})

#: ``torch.<name>`` dtype attribute -> safetensors name
TORCH_DTYPE_NAMES: dict[str, str] = {
    "float64": "F64", "double": "F64", "float32": "F32", "float": "F32", "float16": "F16",
    "half": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "long": "I64", "int32": "I32", "int": "I32", "int16": "I16", "short": "I16",
    "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "bool": "BOOL", "complex64": "C64",
}

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
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
        "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
        "C64": torch.complex64,
    }[name]


def from_torch_dtype(dtype) -> str:
    """The safetensors name of a ``torch.dtype``."""
    return TORCH_DTYPE_NAMES[str(dtype).removeprefix("torch.")]
