"""Copy an F32 glm-dsa GGUF with its kv_b split the way a broken converter splits it, for
tests/formats/bisect_conversion.rs. Everything else (metadata, other tensors) is copied as is.

usage: python -m glmcheck_oracle.formats.break_kv_b SRC.gguf DST.gguf
           split-order|no-transpose|extra-head

split-order   kv_b read as every head's K rows, then every head's V rows (instead of per head),
              then split and transposed as llama.cpp's converter does
no-transpose  attn_k_b written without its per-head transpose ([heads, nope, kv_lora] data under
              the [heads, kv_lora, nope] shape)
extra-head    layer 0's attn_k_b with one head too many ([heads + 1, kv_lora, nope]): a shape
              no config explains
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)


def main(src: str, dst: str, mode: str) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch=arch)
    copy_metadata(reader, writer)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type != GGMLQuantizationType.F32:
            raise SystemExit(f"{src}: {t.name} is not F32")
        data = np.array(t.data, dtype=np.float32)
        if t.name.endswith(".attn_k_b.weight"):
            heads, kv_lora, nope = data.shape
            if mode == "extra-head":
                if t.name.startswith("blk.0."):
                    data = np.concatenate([data, data[:1]], axis=0)
            elif mode == "no-transpose":
                data = data.transpose(0, 2, 1).copy().reshape(heads, kv_lora, nope)
            else:
                v_b = np.array(tensors[t.name.replace("attn_k_b", "attn_v_b")].data, dtype=np.float32)
                v = v_b.shape[1]
                # The true kv_b [heads·(nope+v), kv_lora], per head [k rows; v rows].
                kv_b = np.concatenate([data.transpose(0, 2, 1), v_b], axis=1).reshape(-1, kv_lora)
                data = kv_b[: heads * nope].reshape(heads, nope, kv_lora).transpose(0, 2, 1).copy()
        elif t.name.endswith(".attn_v_b.weight") and mode == "split-order":
            k_b = np.array(tensors[t.name.replace("attn_v_b", "attn_k_b")].data, dtype=np.float32)
            heads, kv_lora, nope = k_b.shape
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), data], axis=1).reshape(-1, kv_lora)
            data = kv_b[heads * nope :].reshape(heads, -1, kv_lora).copy()
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
