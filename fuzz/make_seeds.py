#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/seed-*): valid inputs of
each parser and the hostile ones that once broke them. Deterministic; rerun after a format
change. Inputs found by fuzzing are committed beside the seeds as crash-*.

    protoc --proto_path=proto --python_out=/tmp/py replayssm/v1/replayssm.proto \\
        replayssm/v1/regions.proto replayssm/v1/transfer.proto
    PYTHONPATH=/tmp/py /usr/bin/python3 fuzz/make_seeds.py
"""
import json
import os
import struct

from replayssm.v1 import replayssm_pb2 as pb

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
# fuzz/requests_fuzz.cc: byte 0 chooses the message, byte 1 the model and dtypes.
KIND = {"allocate": 0, "import": 1, "prefill": 2, "decode": 3, "verify": 4, "accept": 5,
        "stream": 6}
F32, BF16, F16 = 0, 1, 2
DTYPE_WIRE = {F32: pb.DTYPE_F32, BF16: pb.DTYPE_BF16, F16: pb.DTYPE_F16}
SIZE = {F32: 4, BF16: 2, F16: 2}
# tiny-gdn / tiny-kda: 4 layers, H=2, HV=4, K=V=32.
LAYERS, H, HV, K, V = 4, 2, 4, 32, 32


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(ROOT, target, "seed-" + name), "wb") as f:
        f.write(data)


def model_byte(kda=False, state=F32, act=F32):
    return (1 if kda else 0) | (state << 1) | (act << 3)


def values(n, dtype, bad=None):
    """n small finite values in dtype's bytes; `bad` = (index, bits) puts raw bits there."""
    out = bytearray()
    for i in range(n):
        x = ((i * 37) % 17 - 8) / 64.0
        if dtype == F32:
            out += struct.pack("<f", x)
        elif dtype == BF16:
            out += struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0])[2:]
        else:
            out += struct.pack("<e", x)
    if bad is not None:
        i, bits = bad
        size = SIZE[dtype]
        out[i * size:(i + 1) * size] = bits.to_bytes(size, "little")
    return bytes(out)


def tensor(shape, dtype, bad=None):
    n = 1
    for d in shape:
        n *= d
    return pb.Tensor(dtype=DTYPE_WIRE[dtype], shape=shape, data=values(n, dtype, bad))


def layers(n, kda=False, act=F32, bad=None):
    out = []
    for l in range(LAYERS):
        a_shape = [n, HV, K] if kda else [n, HV]
        out.append(pb.LayerInput(
            layer=l, mixed_qkv=tensor([n, 2 * H * K + HV * V], act, bad if l == 1 else None),
            a=tensor(a_shape, act), b=tensor([n, HV], act)))
    return out


def request(kind, model, msg):
    return bytes([KIND[kind], model]) + msg.SerializeToString()


def requests():
    write("requests", "allocate", request("allocate", 0, pb.AllocateRequest(
        request_id="a", from_prefix=True, prefix_tokens=[1, 2, 3])))
    write("requests", "accept", request("accept", 0, pb.AcceptRequest(slot=7, num_accepted=2)))
    for kda in (False, True):
        suffix = "-kda" if kda else "-gdn"
        m = model_byte(kda)
        write("requests", "decode" + suffix, request("decode", m, pb.DecodeRequest(
            request_id="d", rows=[pb.DecodeRow(slot=5, token_id=1), pb.DecodeRow(slot=0)],
            layers=layers(2, kda))))
        write("requests", "prefill" + suffix, request("prefill", m, pb.PrefillRequest(
            slot=5, tokens=[1, 2, 3], layers=layers(3, kda), return_outputs=True)))
        write("requests", "verify" + suffix, request("verify", m, pb.VerifyRequest(
            slots=[5], num_draft=2, draft_tokens=[1, 2], layers=layers(2, kda))))
    for act, name in ((BF16, "bf16"), (F16, "f16")):
        write("requests", "decode-" + name, request("decode", model_byte(act=act), pb.DecodeRequest(
            rows=[pb.DecodeRow(slot=5, token_id=1)], layers=layers(1, act=act))))
    # Non-finite activations: refused, naming the field.
    write("requests", "decode-nan", request("decode", 0, pb.DecodeRequest(
        rows=[pb.DecodeRow(slot=5)], layers=layers(1, bad=(3, 0x7fc00000)))))
    write("requests", "decode-bf16-inf", request("decode", model_byte(act=BF16), pb.DecodeRequest(
        rows=[pb.DecodeRow(slot=5)], layers=layers(1, act=BF16, bad=(9, 0xff80)))))
    ck = [tensor([HV, V, K], BF16) for _ in range(LAYERS)]
    write("requests", "import-bf16", request("import", model_byte(state=BF16), pb.ImportRequest(
        slot=5, tokens=[1, 2], checkpoints=ck)))
    ck[2] = tensor([HV, V, K], BF16, bad=(100, 0x7fc1))
    write("requests", "import-bf16-nan", request("import", model_byte(state=BF16),
                                                 pb.ImportRequest(slot=5, checkpoints=ck)))
    stream = [
        ("stream-begin", pb.DecodeStreamRequest(begin=pb.DecodeBegin(
            request_id="s", rows=[pb.DecodeRow(slot=5)]))),
        ("stream-prefill-begin", pb.DecodeStreamRequest(prefill_begin=pb.PrefillBegin(
            request_id="p", rows=[pb.PrefillRow(slot=5, tokens=[1, 2])]))),
        ("stream-verify-begin", pb.DecodeStreamRequest(verify_begin=pb.VerifyBegin(
            request_id="v", slots=[5], num_draft=2, draft_tokens=[1, 2]))),
        ("stream-layer", pb.DecodeStreamRequest(layer=layers(2)[0])),
    ]
    for name, msg in stream:
        write("requests", name, request("stream", 0, msg))


def safetensors_file(tensors):
    """tensors: [(name, dtype, shape, data_offsets or None, bytes)] -> file bytes."""
    header, data = {}, b""
    for name, dtype, shape, offsets, payload in tensors:
        begin = len(data)
        data += payload
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": offsets if offsets is not None else [begin, len(data)]}
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def params(kda, dtype="F32", overrides=None):
    overrides = overrides or {}
    out = []
    for l in range(LAYERS):
        for what, n in (("A_log", HV), ("dt_bias", HV * K if kda else HV)):
            name = f"model.layers.{l}.linear_attn.{what}"
            code = {"F32": F32, "BF16": BF16, "F16": F16}[dtype]
            shape, offsets = [n], None
            if name in overrides:
                shape, offsets = overrides[name]
            out.append((name, dtype, shape, offsets, values(n, code)))
    out.append(("model.embed_tokens.weight", "F32", [2, 2], None, values(4, F32)))
    return out


def safetensors():
    write("safetensors", "gdn-f32", safetensors_file(params(False)))
    write("safetensors", "kda-bf16", safetensors_file(params(True, "BF16")))
    write("safetensors", "gdn-f16", safetensors_file(params(False, "F16")))
    a0 = "model.layers.0.linear_attn.A_log"
    # Hostile headers: negative dimensions whose product is HV, offsets past the file, a
    # fraction, 1e300 (UB when cast to an integer), a header longer than the file.
    write("safetensors", "negative-shape", safetensors_file(params(False, overrides={
        a0: ([-2, -2], None)})))
    write("safetensors", "offsets-past-end", safetensors_file(params(False, overrides={
        a0: ([HV], [1 << 40, (1 << 40) + 16])})))
    write("safetensors", "offsets-huge", safetensors_file(params(False, overrides={
        a0: ([HV], [1e300, 1e300])})))
    write("safetensors", "offsets-negative", safetensors_file(params(False, overrides={
        a0: ([HV], [-16, 0])})))
    write("safetensors", "shape-huge", safetensors_file(params(False, overrides={
        a0: ([1e30, 1e30], None)})))
    write("safetensors", "header-longer-than-file", struct.pack("<Q", 1 << 29) + b"{}")
    nan = bytearray(safetensors_file(params(False)))
    write("safetensors", "truncated", bytes(nan[:len(nan) - 8]))


def hf_configs():
    gdn = {"model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
           "linear_value_head_dim": 32, "torch_dtype": "bfloat16"}
    write("hf_config", "qwen3-next", json.dumps(gdn))
    write("hf_config", "qwen3-5-text-config", json.dumps(
        {"text_config": dict(gdn, layer_types=["linear_attention", "full_attention"] * 2,
                             dtype="float16")}))
    write("hf_config", "kimi-linear", json.dumps(
        {"model_type": "kimi_linear", "torch_dtype": "float32",
         "linear_attn_config": {"num_heads": 4, "head_dim": 32, "kda_layers": [1, 2, 3]}}))
    write("hf_config", "interval-as-string", json.dumps(dict(gdn, full_attention_interval="4")))
    write("hf_config", "many-layers", json.dumps(
        dict(gdn, num_hidden_layers=2147483647, full_attention_interval=0)))
    write("hf_config", "huge-heads", json.dumps(
        {"linear_attn_config": {"num_heads": 65536, "head_dim": 256, "kda_layers": [1] * 64}}))


def server_configs():
    write("server_config", "flags", "--grpc-address=127.0.0.1:0\n--memory-budget=512M\n"
          "--slot-ttl\n30\n--max-batch=16\n\0")
    write("server_config", "file", "\0# replayssm-server\ngrpc-address = 0.0.0.0:50051\n"
          "memory-budget = 4GiB\ntransfer-peers = a:1,b:2\nforward-timeout = 2.5\n")
    write("server_config", "both", "--max-batch=8\n--dedup-bytes=1K\n\0max-batch = 99\n"
          "slot-ttl = nan\nring-length = 99999999999\n")
    write("server_config", "bad", "--memory-budget=9999999999999T\n--nope\n\0= x\nno equals\n")


if __name__ == "__main__":
    requests()
    safetensors()
    hf_configs()
    server_configs()
