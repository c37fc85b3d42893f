"""Helpers of device_run.sh's `cache` step (the kernel disk cache after damage); standard library only.

    cache_damage.py inputs FILE              # q, k, v bf16 [2, 300, 4, 64] (random) as safetensors
    cache_damage.py damage DIR HOW           # HOW: truncate | empty | flip, on every DIR/*.cubin
    cache_damage.py compare WORK HOW DIR     # WORK/HOW.safetensors against WORK/ref (bit for bit)
                                             # and WORK/cpu (within 2e-2); DIR's entries rewritten
"""
import array, json, os, random, struct, sys

SHAPE = [2, 300, 4, 64]


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = (meta["dtype"], raw[8 + n + a : 8 + n + b])
    return out


def as_floats(dtype, data):
    if dtype == "F32":
        return array.array("f", data)
    if dtype == "BF16":
        halves = array.array("H", data)
        return array.array("f", array.array("I", [h << 16 for h in halves]).tobytes())
    raise SystemExit(f"unexpected dtype {dtype}")


def entries(cache_dir):
    return sorted(os.path.join(cache_dir, n) for n in os.listdir(cache_dir) if n.endswith(".cubin"))


def main():
    cmd = sys.argv[1]
    if cmd == "inputs":
        rng = random.Random(20261201)
        n = SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
        tensors = {}
        for name in ["q", "k", "v"]:
            f32 = array.array("f", [rng.uniform(-1.7, 1.7) for _ in range(n)]).tobytes()
            bf16 = array.array("H", [u >> 16 for u in array.array("I", f32)]).tobytes()
            tensors[name] = ("BF16", SHAPE, bf16)
        write_safetensors(sys.argv[2], tensors)
    elif cmd == "damage":
        cache_dir, how = sys.argv[2], sys.argv[3]
        files = entries(cache_dir)
        if not files:
            raise SystemExit(f"no cache entries in {cache_dir}")
        for path in files:
            with open(path, "rb") as f:
                data = bytearray(f.read())
            if how == "truncate":
                data = data[: len(data) // 2]
            elif how == "empty":
                data = bytearray()
            elif how == "flip":
                data[len(data) // 2] ^= 0x40
            else:
                raise SystemExit(f"unknown damage {how}")
            with open(path, "wb") as f:
                f.write(data)
            with open(path + ".damaged", "wb") as f:
                f.write(data)
        print(f"{how}: {len(files)} entries damaged")
    elif cmd == "compare":
        work, how, cache_dir = sys.argv[2], sys.argv[3], sys.argv[4]
        got = read_safetensors(os.path.join(work, how + ".safetensors"))
        ref = read_safetensors(os.path.join(work, "ref.safetensors"))
        cpu = read_safetensors(os.path.join(work, "cpu.safetensors"))
        bad = []
        for name in ["out", "lse"]:
            if got[name] != ref[name]:
                bad.append(f"{name} differs from the first GPU run")
            g, c = as_floats(*got[name]), as_floats(*cpu[name])
            worst = max(abs(x - y) for x, y in zip(g, c)) if len(g) == len(c) else float("inf")
            if not worst <= 2e-2:
                bad.append(f"{name} differs from the CPU by {worst}")
        for path in entries(cache_dir):
            with open(path, "rb") as f, open(path + ".damaged", "rb") as d:
                if f.read() == d.read():
                    bad.append(f"{path} was not rewritten")
            os.remove(path + ".damaged")
        print(f"{how}: " + ("; ".join(bad) if bad else "output as before, entries rewritten"))
        sys.exit(1 if bad else 0)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
