"""Float32 decode linears on x86 CPUs with AVX2 and FMA: grpo's own kernel (`panel_gemm.c`), the weights kept in
16-column panels.

Why: a float32 decode step of the demo's 16 rows is bound by reading the weights and by the arithmetic at once,
and MKL's sgemm (packed or not) does one after the other; the panel kernel prefetches the next panels while it
multiplies the current one (`panel_gemm.c`). The layout serves every row count (no repacking as rows finish) and
costs the weight's own size (MKL's packed layout is several times larger). Measurements: `bench/RESULTS.md`.

No weight is narrowed: every output is one float32 sum of fused multiply-adds in order over k, so results differ
from MKL's blocked sums in the last bits only (tests: against `F.linear`, and the lean decoder against the
transformers forward). Packing is C too (`grpo_pack_panels`: from the weights' parts, so q/k/v and gate/up are
never concatenated; 8 x 8 blocks transposed in AVX2 registers), once per rollout, an order of magnitude faster
than torch's transposing copy and concatenations.

`decode_layers` runs a whole decode step's layers in one call (`grpo_decode_layers`): RMSNorm, q/k/v, RoPE, the
key/value writes, grouped-query attention over the buffers, o, the MLP with SiLU, the residual adds, each as the
torch path computes it, in float32 with AVX2 (exp by Cephes' polynomial, within 2 ulp of expf), which saves the
~35 torch operators a layer around the matmuls. Tests: the fused step against the transformers forward (GQA,
biases, scaled RoPE, tied head) and against the per-operator path, within float32 rounding.

The C source is built at install, where a C compiler with OpenMP and an x86 target allow (`setup.py`: an optional
extension, `grpo.rollout.cpu._panel_gemm`, loaded here with ctypes; no compiling or caching at run time). Without
it, on other CPUs, or when the file cannot be loaded (logged once), the lean decoder keeps MKL's packed sgemm
(`grpo.rollout.cpu.packed`), and `available()` says so. The file is checked before the dynamic loader maps it
(`elf_problem`: every segment and the section headers within the file), since a file cut short (a half-copied
environment) would be mapped all the same and kill the process with SIGBUS at the first page past its end. It is
found by Python's import system in grpo's own package directory (`grpo.rollout.cpu.__path__`) only: a copy in the
working directory, on PYTHONPATH or in a temporary or cache directory is never loaded
(tests/integration/test_kernel_file.py).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import platform
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from grpo.models.modeling import cpu_flags
from grpo.perf.kernels import Linear

logger = logging.getLogger("grpo")
EXTENSION = "grpo.rollout.cpu._panel_gemm"  # panel_gemm.c, built by setup.py
MAX_ROWS = 256  # more rows (a long prefill) take the plain matmul on the weight itself


# ELF64 little-endian (x86-64) headers: the file header (e_ident, e_type, e_machine, e_version, e_entry, e_phoff,
# e_shoff, e_flags, e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx), a program header (p_type,
# p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align), a section header (sh_name, sh_type, sh_flags,
# sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign, sh_entsize)
ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
PROGRAM_HEADER = struct.Struct("<IIQQQQQQ")
SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")
ET_DYN, EM_X86_64, PT_LOAD, SHT_NOBITS = 3, 62, 1, 8


def elf_problem(path: str) -> str | None:
    """Why the kernel file at `path` must not be mapped, or None where it is whole. Read from its ELF headers
    before the dynamic loader sees it: a file cut short (a half-copied environment) or a header whose segments lie
    past the file's end is mapped all the same, and the first touch of a page past the end kills the process with
    SIGBUS. Checked: an x86-64 ELF64 shared object, whose program headers, every segment's file bytes, section
    header table and every section's file bytes lie within the file (a file of the right size with damaged code is
    not found here)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # never blocks on a FIFO
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                return "not a regular file"
            return _elf_layout_problem(f, info.st_size)
    except (OSError, struct.error) as err:
        return f"the file cannot be read ({err})"


def _elf_layout_problem(f: Any, size: int) -> str | None:
    """`elf_problem` of the open file `f` of `size` bytes."""

    def read(offset: int, count: int) -> bytes:
        f.seek(offset)
        return f.read(count)

    head = read(0, ELF_HEADER.size)
    if size < 4 or head[:4] != b"\x7fELF":
        return f"the file is {size} bytes, not an ELF shared library"
    if size < ELF_HEADER.size:
        return f"its ELF header is cut short: the file is {size} bytes, the header {ELF_HEADER.size}"
    ident, e_type, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = ELF_HEADER.unpack(head)
    if ident[4:6] != b"\x02\x01":
        return f"not a 64-bit little-endian ELF file (class {ident[4]}, data {ident[5]}; the file is {size} bytes)"
    if e_type != ET_DYN or machine != EM_X86_64:
        return f"not an x86-64 shared library (ELF type {e_type}, machine {machine}; the file is {size} bytes)"
    return _segments_problem(read, size, phoff, phentsize, phnum) or _sections_problem(
        read, size, shoff, shentsize, shnum
    )


def _past_end(size: int) -> str:
    return f"past the file's end: the file is {size} bytes (truncated, or its headers are damaged)"


def _segments_problem(read: Any, size: int, phoff: int, phentsize: int, phnum: int) -> str | None:
    """The program headers and every segment's file bytes within the file; a loadable segment among them."""
    if phentsize != PROGRAM_HEADER.size or not 0 < phnum < 0xFFFF:
        return f"its program header table is damaged ({phnum} entries of {phentsize} bytes; the file is {size} bytes)"
    if phoff + phnum * phentsize > size:
        return f"its program header table ends at byte {phoff + phnum * phentsize}, {_past_end(size)}"
    table = read(phoff, phnum * phentsize)
    segments = [PROGRAM_HEADER.unpack_from(table, i * phentsize) for i in range(phnum)]
    if not any(s[0] == PT_LOAD for s in segments):
        return f"it has no loadable segment (the file is {size} bytes)"
    for i, (p_type, _, offset, _, _, filesz, memsz, _) in enumerate(segments):
        if offset + filesz > size:
            return f"its segment {i} ends at byte {offset + filesz}, {_past_end(size)}"
        if p_type == PT_LOAD and filesz > memsz:
            return f"its segment {i} has more file bytes than memory ({filesz} > {memsz}; the file is {size} bytes)"
    return None


def _sections_problem(read: Any, size: int, shoff: int, shentsize: int, shnum: int) -> str | None:
    """The section header table and every section's file bytes within the file (a file without one: nothing)."""
    if shoff == 0:  # no section header table (stripped to the bone): the segments are what is mapped
        return None
    if shentsize != SECTION_HEADER.size or shoff + SECTION_HEADER.size > size:
        return f"its section header table (at byte {shoff}, entries of {shentsize} bytes) lies {_past_end(size)}"
    count = shnum or SECTION_HEADER.unpack(read(shoff, SECTION_HEADER.size))[5]  # over 0xff00: in entry 0
    if shoff + count * shentsize > size:
        return f"its section header table ends at byte {shoff + count * shentsize}, {_past_end(size)}"
    table = read(shoff, count * shentsize)
    for i in range(count):
        _, sh_type, _, _, offset, length, *_ = SECTION_HEADER.unpack_from(table, i * shentsize)
        if sh_type != SHT_NOBITS and offset + length > size:
            return f"its section {i} ends at byte {offset + length}, {_past_end(size)}"
    return None


ABI_VERSION = 2  # panel_gemm.c's grpo_abi_version: the layout of `Layer` and grpo_decode_layers' arguments


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel built at install (`setup.py`), or None where it cannot run here (logged once)."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        return None
    spec = importlib.util.find_spec(EXTENSION)
    if spec is None or spec.origin is None:
        logger.info(
            "grpo's panel kernel was not built at install (no C compiler or OpenMP then): float32 decoding uses "
            "MKL's packed sgemm. Reinstall grpo where `cc` works to build it."
        )
        return None
    problem = elf_problem(spec.origin)
    if problem is not None:  # mapped, it could kill the process (SIGBUS) instead of failing to load
        logger.warning(
            "grpo's panel kernel %s is damaged (%s): float32 decoding uses MKL's packed sgemm. Reinstall grpo to "
            "rebuild it.",
            spec.origin,
            problem,
        )
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.grpo_panel_gemm.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4
    except (OSError, AttributeError) as err:  # a damaged file, or another build's
        logger.warning(
            "grpo's panel kernel %s cannot be loaded (%s): float32 decoding uses MKL's packed sgemm. Reinstall grpo "
            "to rebuild it.",
            spec.origin,
            err,
        )
        return None
    version = getattr(lib, "grpo_abi_version", None)
    if version is None or version() != ABI_VERSION:  # an install of another grpo: its layer layout differs
        logger.warning(
            "grpo's panel kernel %s was built for another version of grpo: float32 decoding uses MKL's packed "
            "sgemm. Reinstall grpo to rebuild it.",
            spec.origin,
        )
        return None
    lib.grpo_panel_gemm.restype = ctypes.c_int
    lib.grpo_pack_panels.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.grpo_pack_panels.restype = ctypes.c_int
    lib.grpo_decode_layers.argtypes = [
        *[ctypes.c_int] * 7,
        *[ctypes.c_float] * 2,
        *[ctypes.c_int] * 2,
        ctypes.POINTER(Layer),
        *[ctypes.c_void_p] * 4,
    ]
    lib.grpo_decode_layers.restype = ctypes.c_int
    return lib


def _loaded() -> ctypes.CDLL:
    """`library()` for a caller that checked `available()` first."""
    lib = library()
    assert lib is not None, "grpo's panel kernel is not available here: check available() first"
    return lib


def available(weight: torch.Tensor) -> bool:
    """Whether `weight` can take the panel kernel here: a float32 CPU tensor, on a CPU and machine that build it."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and library() is not None


def pack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(N_i, K) weights, stacked by rows as one (sum N_i, K) matrix -> its panels (ceil(N / 16), K, 16): column j
    of panel p is row 16 p + j (zeros past N). The C library reads the parts in place: nothing is concatenated."""
    parts = [w.detach().float().contiguous() for w in parts]
    if not parts or any(w.dim() != 2 or w.shape[1] != parts[0].shape[1] for w in parts):
        raise ValueError(f"pack: weights of one width expected, got {[tuple(w.shape) for w in parts]}")
    n, k = sum(w.shape[0] for w in parts), parts[0].shape[1]
    panels = torch.empty((n + 15) // 16, k, 16, dtype=torch.float32)
    pointers = (ctypes.c_void_p * len(parts))(*[w.data_ptr() for w in parts])
    rows = (ctypes.c_int * len(parts))(*[w.shape[0] for w in parts])
    _loaded().grpo_pack_panels(len(parts), pointers, rows, k, panels.data_ptr())
    return panels


class PanelLinear:
    """x -> x @ W.T + bias in float32 by the panel kernel, W the `parts` stacked by rows (q, k and v: one matmul),
    for inputs of up to MAX_ROWS rows (more: F.linear on W, stacked then, once). The panels are a copy: later
    changes to the parts are not seen. `panels` and `bias` are what `decode_layers` reads."""

    def __init__(self, parts: Sequence[torch.Tensor], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self.panels = pack(parts)
        self.n, self.k = sum(w.shape[0] for w in parts), parts[0].shape[1]
        if self.bias is not None and self.bias.shape != (self.n,):  # the C code reads n biases
            raise ValueError(f"panel_linear: a bias of {tuple(self.bias.shape)} for {self.n} outputs")
        self.stacked: torch.Tensor | None = None  # W itself, made on the first input of over MAX_ROWS rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k)
        rows = flat.shape[0]
        if rows > MAX_ROWS or flat.dtype != torch.float32:
            if self.stacked is None:
                self.stacked = torch.cat([w.detach() for w in self.parts]) if len(self.parts) > 1 else self.parts[0]
            return F.linear(x, self.stacked.detach(), self.bias)
        flat = flat.contiguous()
        out = torch.empty(rows, self.n, dtype=torch.float32)
        _loaded().grpo_panel_gemm(
            rows, self.n, self.k, flat.data_ptr(), self.panels.data_ptr(), _ptr(self.bias), out.data_ptr()
        )
        return out.reshape(*x.shape[:-1], self.n)


def panel_linear(parts: Sequence[torch.Tensor], bias: torch.Tensor | None) -> Linear:
    """`PanelLinear` of these parts and bias."""
    return PanelLinear(parts, bias)


class Layer(ctypes.Structure):
    """One decoder layer as `grpo_decode_layers` reads it (panel_gemm.c's grpo_layer): float32 pointers."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "norm1",
            "norm2",
            "qkv",
            "qkv_bias",
            "o",
            "o_bias",
            "gate_up",
            "gate_up_bias",
            "down",
            "down_bias",
            "qk_norm",
            "keys",
            "values",
        )
    ]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


def layer_table(layers: Sequence[dict[str, Any]]) -> ctypes.Array:
    """The layers' norm weights (and query/key norm tables, `qk_norm`) and panel linears (`qkv`, `o`, `gate_up`,
    `down`: PanelLinear) as `decode_layers` reads them; `set_caches` fills in the key/value buffers."""
    table = (Layer * len(layers))()
    for entry, layer in zip(table, layers):
        entry.norm1, entry.norm2 = layer["norm1_weight"].data_ptr(), layer["norm2_weight"].data_ptr()
        qk_norm = layer.get("qk_norm")  # (a float32 contiguous (heads + kv_heads, 1, head_dim) table, eps, _) or None
        entry.qk_norm = qk_norm[0].data_ptr() if qk_norm is not None else None
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(entry, name, layer[name].panels.data_ptr())
            setattr(entry, f"{name}_bias", _ptr(layer[name].bias))
    return table


def _set_caches(
    table: ctypes.Array, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], shape: tuple
) -> None:
    """Each layer's key and value buffers into the table, checked: float32, contiguous, all of `shape`."""
    if len(keys) != len(table) or len(values) != len(table):
        raise ValueError(f"decode_layers: {len(keys)} key buffers for {len(table)} layers")
    for t in (*keys, *values):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"decode_layers: a {tuple(t.shape)} {t.dtype} key/value buffer where {shape} is read")
    for entry, k, v in zip(table, keys, values):
        entry.keys, entry.values = k.data_ptr(), v.data_ptr()


@dataclass(frozen=True)
class Sizes:
    """A decoder's sizes, as `decode_layers` needs them."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float  # every RMSNorm's
    scale: float  # attention's


def decode_layers(
    table: ctypes.Array,
    sizes: Sizes,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    position: int,
) -> None:
    """Every layer of one decode step, in place on the residual stream x (rows, hidden), in one call
    (panel_gemm.c's grpo_decode_layers): cos and sin (rows, head_dim) the rotary embedding at each row's position,
    mask (rows, position + 1) additive (0 or -inf), each layer's key and value buffers (rows, kv_heads, width,
    head_dim), this step's keys and values written at `position`. All float32 and contiguous: checked here, since
    the C code trusts its sizes."""
    rows, steps = x.shape[0], position + 1
    expected = {x: (rows, sizes.hidden), cos: (rows, sizes.head_dim), sin: (rows, sizes.head_dim), mask: (rows, steps)}
    for tensor, shape in expected.items():
        if tuple(tensor.shape) != shape or tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"decode_layers: a {tuple(tensor.shape)} {tensor.dtype} input where {shape} is read")
    width = keys[0].shape[2] if keys and keys[0].dim() == 4 else 0
    if width < steps:
        raise ValueError(f"decode_layers: key/value buffers {width} wide, written at position {position}")
    _set_caches(table, keys, values, (rows, sizes.kv_heads, width, sizes.head_dim))
    failed = _loaded().grpo_decode_layers(
        x.shape[0],
        len(table),
        sizes.hidden,
        sizes.heads,
        sizes.kv_heads,
        sizes.head_dim,
        sizes.intermediate,
        ctypes.c_float(sizes.eps),
        ctypes.c_float(sizes.scale),
        width,
        position,
        table,
        cos.data_ptr(),
        sin.data_ptr(),
        mask.data_ptr(),
        x.data_ptr(),
    )
    if failed:
        raise MemoryError("grpo's decode step could not allocate its working memory")
