"""A small safetensors reader and writer for torch tensors, so that Shard's exports load with
model.load_state_dict(load_file(path), strict=True) and a state_dict can become a job's
init.path, without the safetensors package.

The format: an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the tensors' bytes, little-endian and
row-major, offsets relative to the end of the header.
"""

import json
import struct

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def load_file(path):
    """{name: tensor} of the file's tensors (copies, on the cpu)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise ValueError(f"{path}: header length {header_len} runs past the end of the file")
    header = json.loads(data[8:8 + header_len])
    body = memoryview(data)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, not one torch reads")
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= len(body):
            raise ValueError(f"{path}: tensor {name} lies outside the file ({begin}..{end})")
        dtype = _DTYPES[info["dtype"]]
        chunk = bytearray(body[begin:end])
        flat = torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"]).clone()
    return tensors


def metadata(path):
    """The file's "__metadata__" (e.g. Shard's step), {} if it has none."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(header_len)).get("__metadata__", {})


def save_file(tensors, path, metadata=None):
    """Writes {name: tensor} (e.g. model.state_dict()) as safetensors."""
    header, chunks, offset = {}, [], 0
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype not in _NAMES:
            raise ValueError(f"tensor {name} has dtype {tensor.dtype}, which safetensors lacks")
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for chunk in chunks:
            f.write(chunk)
