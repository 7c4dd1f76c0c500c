"""The benchmark checkpoint: a llama-like layer layout, deterministic from a seed.

Every tensor is regenerated on demand from (seed, its index), so a loader's result is checked
bit for bit against the source without keeping a copy: on the GPU with torch (Philox), or on
the host with numpy (Philox) where torch or CUDA is missing. The manifest records which
backend wrote the files; verification uses the same one.

Layout (names as in Hugging Face llama checkpoints):
  model.embed_tokens.weight, lm_head.weight, model.norm.weight               bf16
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight                           bf16
  model.layers.{i}.mlp.{gate,up,down}_proj.weight                            bf16
  model.layers.{i}.{input,post_attention}_layernorm.weight                   bf16
and, after the bf16 layers, FP8 layers (float8_e4m3fn linear weights, per-tensor
weight_scale_inv and weight_amax as F32[1], bf16 norms) with a TransformerEngine-like
DelayedScaling state per linear module: forward slots input/weight/output, backward slots
grad_output/grad_input, scale F32[S] and amax_history F32[1024, S]. TensorFerry stores that
state as structured data; the other formats get it as plain tensors named
  {module}._fp8_state.{forward,backward}.{scale,amax_history}
"""

import math

BF16, FP8, F32 = "BF16", "F8_E4M3FN", "F32"
ITEMSIZE = {BF16: 2, FP8: 1, F32: 4}
FP8_MAX = 448.0
AMAX_HISTORY_LEN = 1024
FORWARD_SLOTS = ["input", "weight", "output"]
BACKWARD_SLOTS = ["grad_output", "grad_input"]
RECIPE = {"type": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID",
          "amax_history_len": AMAX_HISTORY_LEN, "amax_compute_algo": "max",
          "reduce_amax": True, "fp8_dpa": False, "fp8_mha": False}

# (hidden, intermediate, vocab, kv width) by target size: llama-3-8B, TinyLlama-like, tiny.
_DIMS = [(2.0, (4096, 14336, 128256, 1024)), (0.25, (2048, 5632, 32000, 256)),
         (0.0, (512, 1536, 8192, 128))]


class Spec:
    """One tensor: name, dtype, shape, how its values are made (kind, std), index (its seed)."""

    __slots__ = ("name", "dtype", "shape", "kind", "std", "index", "amax")

    def __init__(self, name, dtype, shape, kind, std=0.0, amax=0.0):
        self.name, self.dtype, self.shape, self.kind = name, dtype, tuple(shape), kind
        self.std, self.amax, self.index = std, amax, -1

    @property
    def numel(self):
        return math.prod(self.shape)

    @property
    def nbytes(self):
        return self.numel * ITEMSIZE[self.dtype]

    def to_json(self):
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "kind": self.kind, "std": self.std, "amax": self.amax, "index": self.index}


def dims_for(size_gib):
    for threshold, dims in _DIMS:
        if size_gib >= threshold:
            return dims
    return _DIMS[-1][1]


def _linear_shapes(h, inter, kv):
    return [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
            ("mlp.down_proj", (h, inter))]


def layout(size_gib):
    """(specs, scaling modules, config). The bf16 part alone reaches size_gib; FP8 layers (one
    per eight bf16 layers, at least one) come on top."""
    h, inter, vocab, kv = dims_for(size_gib)
    target = size_gib * (1 << 30)
    linears = _linear_shapes(h, inter, kv)
    per_layer = sum(a * b for _, (a, b) in linears) * 2 + 2 * h * 2
    fixed = 2 * vocab * h * 2 + h * 2
    n_bf16 = max(2, math.ceil((target - fixed) / per_layer))
    n_fp8 = max(1, n_bf16 // 8)
    std = 0.02
    specs = [Spec("model.embed_tokens.weight", BF16, (vocab, h), "normal", std)]
    modules = []
    for i in range(n_bf16 + n_fp8):
        p = "model.layers.%d." % i
        fp8 = i >= n_bf16
        specs.append(Spec(p + "input_layernorm.weight", BF16, (h,), "norm", 0.01))
        for lin, shape in linears:
            if not fp8:
                specs.append(Spec(p + lin + ".weight", BF16, shape, "normal", std))
                continue
            amax = 4.5 * std
            specs.append(Spec(p + lin + ".weight", FP8, shape, "fp8", std, amax))
            specs.append(Spec(p + lin + ".weight_scale_inv", F32, (1,), "const",
                              amax=amax / FP8_MAX))
            specs.append(Spec(p + lin + ".weight_amax", F32, (1,), "const", amax=amax))
            modules.append(p + lin)
        specs.append(Spec(p + "post_attention_layernorm.weight", BF16, (h,), "norm", 0.01))
    specs.append(Spec("model.norm.weight", BF16, (h,), "norm", 0.01))
    specs.append(Spec("lm_head.weight", BF16, (vocab, h), "normal", std))
    for j, s in enumerate(specs):
        s.index = j
    config = {"hidden": h, "intermediate": inter, "vocab": vocab, "kv_width": kv,
              "bf16_layers": n_bf16, "fp8_layers": n_fp8, "target_gib": size_gib}
    return specs, modules, config


def state_specs(modules, first_index):
    """Plain-tensor form of the DelayedScaling state (for formats without structured state)."""
    out = []
    for m in modules:
        for direction, slots in (("forward", FORWARD_SLOTS), ("backward", BACKWARD_SLOTS)):
            s = len(slots)
            base = "%s._fp8_state.%s." % (m, direction)
            out.append(Spec(base + "scale", F32, (s,), "scale"))
            out.append(Spec(base + "amax_history", F32, (AMAX_HISTORY_LEN, s), "amax_history"))
    for j, s in enumerate(out):
        s.index = first_index + j
    return out


def sample_names(specs, modules):
    """Tensors every loader's result is checked against bit for bit: the first and last
    tensor, every kind of tensor of the first layer, the last bf16 layer's down_proj, one FP8
    linear with its scale_inv and amax, the final norm, and one module's state tensors."""
    names = [specs[0].name, specs[-1].name, "model.norm.weight"]
    p0 = "model.layers.0."
    for s in specs:
        if s.name.startswith(p0):
            names.append(s.name)
    bf16_layers = {s.name.split(".")[2] for s in specs
                   if s.name.startswith("model.layers.") and s.dtype == BF16 and
                   s.name.endswith("down_proj.weight")}
    last = max(int(x) for x in bf16_layers)
    names.append("model.layers.%d.mlp.down_proj.weight" % last)
    if modules:
        m = modules[len(modules) // 2]
        names += [m + ".weight", m + ".weight_scale_inv", m + ".weight_amax"]
        for direction in ("forward", "backward"):
            names += ["%s._fp8_state.%s.scale" % (modules[0], direction),
                      "%s._fp8_state.%s.amax_history" % (modules[0], direction)]
    seen = set()
    return [n for n in names if not (n in seen or seen.add(n))]


def _seed(seed, index):
    return (seed * 1000003 + index * 7919 + 12345) & ((1 << 62) - 1)


# ---- torch backend (GPU) ------------------------------------------------------------------


def make_torch(spec, seed, device):
    """The tensor of `spec` on `device`, deterministic for (seed, spec.index)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(_seed(seed, spec.index))
    shape = spec.shape
    if spec.kind == "normal":
        x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        return x.mul_(spec.std).to(torch.bfloat16)
    if spec.kind == "norm":
        x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        return x.mul_(spec.std).add_(1.0).to(torch.bfloat16)
    if spec.kind == "fp8":
        x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        x.mul_(spec.std * FP8_MAX / spec.amax).clamp_(-FP8_MAX, FP8_MAX)
        return x.to(torch.float8_e4m3fn)
    if spec.kind == "const":
        return torch.full(shape, spec.amax, device=device, dtype=torch.float32)
    if spec.kind == "scale":
        return torch.rand(shape, generator=g, device=device, dtype=torch.float32).add_(0.5)
    if spec.kind == "amax_history":
        return torch.rand(shape, generator=g, device=device, dtype=torch.float32).mul_(0.1)
    raise ValueError(spec.kind)


def torch_dtype(dtype):
    import torch

    return {BF16: torch.bfloat16, FP8: torch.float8_e4m3fn, F32: torch.float32}[dtype]


def torch_equal_bits(a, b):
    """Bit-exact equality of two torch tensors (same shape, same bytes)."""
    import torch

    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    a = a.contiguous().reshape(-1).view(torch.uint8)
    b = b.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a, b.to(a.device)))


# ---- numpy backend (host) -----------------------------------------------------------------


def numpy_dtype(dtype):
    import ml_dtypes
    import numpy as np

    return {BF16: np.dtype(ml_dtypes.bfloat16), FP8: np.dtype(ml_dtypes.float8_e4m3fn),
            F32: np.dtype(np.float32)}[dtype]


def make_numpy(spec, seed):
    import numpy as np

    rng = np.random.Generator(np.random.Philox(_seed(seed, spec.index)))
    shape = spec.shape
    dt = numpy_dtype(spec.dtype)
    if spec.kind == "normal":
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.std)).astype(dt)
    if spec.kind == "norm":
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.std) + np.float32(1)
        return x.astype(dt)
    if spec.kind == "fp8":
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(spec.std * FP8_MAX / spec.amax)
        np.clip(x, -FP8_MAX, FP8_MAX, out=x)
        return x.astype(dt)
    if spec.kind == "const":
        return np.full(shape, spec.amax, dtype=np.float32)
    if spec.kind == "scale":
        return rng.random(shape, dtype=np.float32) + np.float32(0.5)
    if spec.kind == "amax_history":
        return rng.random(shape, dtype=np.float32) * np.float32(0.1)
    raise ValueError(spec.kind)


def numpy_equal_bits(a, b):
    import numpy as np

    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if tuple(a.shape) != tuple(b.shape) or a.nbytes != b.nbytes:
        return False
    return bool(np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))


def wsum(buf):
    """Position-weighted checksum of raw bytes: sum of w[i] * (2i + 1) mod 2**64 over the
    little-endian 64-bit words (zero-padded). Any single changed word changes it (odd weights
    are invertible mod 2**64). ferry_load.c computes the same on what it loaded."""
    import numpy as np

    b = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    pad = (-b.size) % 8
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    w = b.view("<u8")
    total = 0
    step = 1 << 24
    for lo in range(0, w.size, step):
        chunk = w[lo:lo + step]
        weights = np.arange(lo, lo + chunk.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        with np.errstate(over="ignore"):
            total = (total + int(np.sum(chunk * weights, dtype=np.uint64))) % (1 << 64)
    return total


def scaling_state_from(tensors_by_name, modules):
    """The structured DelayedScaling state (tensorferry._scaling form) from the plain state
    tensors (numpy or torch)."""
    out = {}
    for m in modules:
        states = []
        for direction, slots in (("forward", FORWARD_SLOTS), ("backward", BACKWARD_SLOTS)):
            base = "%s._fp8_state.%s." % (m, direction)
            states.append({"direction": direction, "num_gemms": 1, "slot_roles": list(slots),
                           "scale": tensors_by_name[base + "scale"],
                           "amax_history": tensors_by_name[base + "amax_history"]})
        out[m] = {"recipe": dict(RECIPE), "states": states}
    return out
