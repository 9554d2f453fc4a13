"""grpo's CPU kernel file (`grpo.rollout.cpu._panel_gemm`, built by setup.py at install) is loaded only when it is
whole, only from grpo's own package, and never compiled at run time:
- a damaged file (truncated: a half-copied environment; or a header whose segments lie past the file's end) is found
  from its ELF headers before it is mapped, and float32 decoding falls back to MKL with one log line: mapping such a
  file would kill the process with SIGBUS, so these run in a child process;
- copies planted in the working directory, PYTHONPATH, TMPDIR or a cache directory are never loaded;
- no process (a compiler) starts while the kernel is loaded and decodes, with cc, gcc, ... on PATH."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.rollout.cpu import panels

SPEC = importlib.util.find_spec(panels.EXTENSION)
GENUINE = Path(SPEC.origin) if SPEC is not None and SPEC.origin is not None else None
ROOT = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(
    GENUINE is None or panels.library() is None,
    reason="grpo was installed without its kernel, or this CPU cannot run it (no x86 AVX2/FMA)",
)

ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
PROGRAM_HEADER = struct.Struct("<IIQQQQQQ")


def _headers(data: bytes) -> tuple[tuple, list[tuple]]:
    header = ELF_HEADER.unpack_from(data)
    phoff, phnum = header[5], header[10]
    return header, [PROGRAM_HEADER.unpack_from(data, phoff + i * PROGRAM_HEADER.size) for i in range(phnum)]


def damaged_copies(directory: Path) -> dict[str, Path]:
    """The installed kernel, damaged: cut to half its size (the section headers and debug info lost, every loaded
    segment whole), cut inside its code (loaded segments past the end: SIGBUS when mapped), and whole but with a
    loaded segment's file offset moved past the end (page-aligned, as the loader requires)."""
    assert GENUINE is not None
    data = GENUINE.read_bytes()
    header, segments = _headers(data)
    loads = [i for i, s in enumerate(segments) if s[0] == 1]  # PT_LOAD
    last_load = segments[loads[-1]]
    moved = bytearray(data)
    index = loads[-1]
    offset = header[5] + index * PROGRAM_HEADER.size + 8  # p_offset, after p_type and p_flags
    struct.pack_into("<Q", moved, offset, last_load[2] + ((len(data) + 0xFFF) & ~0xFFF))  # the same page offset
    first_code = segments[loads[1]][2] if len(loads) > 1 else 0x1000
    copies = {
        "half": data[: len(data) // 2],
        "cut in its code": data[: first_code + 0x800],
        "segment past the end": bytes(moved),
    }
    paths = {}
    for i, (case, content) in enumerate(copies.items()):
        path = directory / f"case{i}" / GENUINE.name  # the name the package's import lookup finds
        path.parent.mkdir(parents=True)
        path.write_bytes(content)
        paths[case] = path
    return paths


# ---- the check of the file ------------------------------------------------------------------------------------


@needs_kernel
def test_the_installed_kernel_passes_the_check():
    assert panels.elf_problem(str(GENUINE)) is None


@needs_kernel
def test_a_truncated_or_damaged_kernel_file_is_found_before_it_is_mapped(tmp_path):
    for case, path in damaged_copies(tmp_path).items():
        problem = panels.elf_problem(str(path))
        assert problem is not None and str(path.stat().st_size) in problem, (case, problem)
    empty, text, other = tmp_path / "empty.so", tmp_path / "text.so", tmp_path / "other.so"
    empty.write_bytes(b"")
    text.write_bytes(b"\x7fELF not really a library")
    data = bytearray(GENUINE.read_bytes())
    data[18:20] = struct.pack("<H", 183)  # e_machine: AArch64
    other.write_bytes(bytes(data))
    assert "not an ELF" in panels.elf_problem(str(empty))
    assert "header" in panels.elf_problem(str(text))
    assert "x86-64" in panels.elf_problem(str(other))
    assert "cannot be read" in panels.elf_problem(str(tmp_path / "missing.so"))


# ---- falling back, in a child process -------------------------------------------------------------------------

DECODE = r"""
import json, logging, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from grpo.base.records import left_pad
from grpo.rollout.lean_decoder import LeanDecoder


def decode():
    '''Three float32 decode steps of a tiny Llama through the lean decoder, against the transformers forward:
    (whether the panel kernel ran, the largest log-prob difference).'''
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    prompts, owner = [[5, 9, 11, 13, 7], [8, 3]], torch.tensor([0, 0, 1, 1])
    ids, mask = left_pad(prompts, 0)
    dec = LeanDecoder(model, torch.float32)
    logits = dec.prefill(ids, mask, owner, max_new=32)
    seqs, worst = [list(prompts[o]) for o in owner.tolist()], 0.0
    for step in range(3):
        with torch.no_grad():
            expected = torch.stack([torch.log_softmax(model(torch.tensor([s])).logits[0, -1], -1) for s in seqs])
        worst = max(worst, (torch.log_softmax(logits, -1) - expected).abs().max().item())
        tokens = torch.tensor([7 + step, 20, 31, 40 + step])
        for s, t in zip(seqs, tokens.tolist()):
            s.append(t)
        logits = dec.step(tokens)
    return dec.in_panels, worst


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


lines = Lines()
logging.getLogger("grpo").addHandler(lines)
logging.getLogger("grpo").setLevel(logging.DEBUG)
"""

FALL_BACK = (
    DECODE
    + r"""
import grpo.rollout.cpu
from grpo.rollout.cpu import panels

for case, directory in json.loads(sys.argv[1]).items():
    grpo.rollout.cpu.__path__[:] = [directory]  # the package's directory holds the damaged file
    panels.library.cache_clear()
    lines.lines.clear()
    print(case, "...", file=sys.stderr, flush=True)  # a crash names the case it died in
    in_panels, worst = decode()
    print(json.dumps({"case": case, "in_panels": in_panels, "worst": worst, "lines": lines.lines}), flush=True)
"""
)


@needs_kernel
def test_a_damaged_kernel_file_falls_back_to_mkl_with_one_log_line(tmp_path):
    """Each damaged copy where the package looks for the kernel: the child process decodes (no SIGBUS), on MKL's
    path, with next-token log-probs equal to the transformers forward's (within float32 rounding), and logs one
    line naming the file. The installed kernel, last, still loads (no log line) and gives the same numbers."""
    cases = {case: str(path.parent) for case, path in damaged_copies(tmp_path).items()}
    cases["installed"] = str(GENUINE.parent)
    done = subprocess.run(
        [sys.executable, "-c", FALL_BACK, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, f"status {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    results = {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert list(results) == list(cases)
    for case, path in cases.items():
        result = results[case]
        assert result["worst"] < 1e-4, result
        if case == "installed":
            assert result["in_panels"] and result["lines"] == [], result
            continue
        assert not result["in_panels"], result
        (line,) = result["lines"]
        assert "MKL's packed sgemm" in line and path in line and "\n" not in line, (case, line)


# ---- nothing planted is loaded, nothing is compiled -----------------------------------------------------------

PLANTED = (
    DECODE
    + r"""
events = []


def audit(event, args):
    if event in ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn", "os.fork"):
        events.append([event, repr(args)[:200]])
    elif event == "ctypes.dlopen":
        events.append([event, str(args[0])])


sys.addaudithook(audit)
from grpo.rollout.cpu import panels

in_panels, worst = decode()
lib = panels.library()
with open("/proc/self/maps") as f:
    mapped = sorted({line.split()[-1] for line in f if "/" in line})
print(json.dumps({"in_panels": in_panels, "worst": worst, "library": lib and lib._name, "events": events,
                  "mapped": mapped, "lines": lines.lines}))
"""
)

COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++", "ld", "nvcc", "x86_64-linux-gnu-gcc")


@needs_kernel
def test_only_the_installed_kernel_is_loaded_and_nothing_is_compiled(tmp_path):
    """Copies of the kernel (working libraries) in the working directory, on PYTHONPATH, in TMPDIR and the cache
    directories, at the names Python's import system would try; and compilers on PATH that leave a mark when run.
    The child decodes on the installed kernel only, maps none of the planted files and starts no process."""
    planted = tmp_path / "planted"
    names = [GENUINE.name, "_panel_gemm.so", "_panel_gemm.abi3.so"]
    places = ["cwd", "pythonpath", "tmp", "cache", "home", "extensions"]
    for place in places:
        for folder in ("", "grpo/rollout/cpu", "grpo"):  # a namespace-package look-alike: no __init__.py
            for name in names:
                (planted / place / folder).mkdir(parents=True, exist_ok=True)
                shutil.copy(GENUINE, planted / place / folder / name)
    bin_dir, mark = tmp_path / "bin", tmp_path / "compiled"
    bin_dir.mkdir()
    for compiler in COMPILERS:
        (bin_dir / compiler).write_text(f'#!/bin/sh\necho "$0 $*" >> {mark}\nexit 1\n')
        (bin_dir / compiler).chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(planted / "pythonpath"), str(ROOT / "src")]),
        "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
        "CC": str(bin_dir / "cc"),
        "CXX": str(bin_dir / "c++"),
        "TMPDIR": str(planted / "tmp"),
        "XDG_CACHE_HOME": str(planted / "cache"),
        "HOME": str(planted / "home"),
        "TORCH_EXTENSIONS_DIR": str(planted / "extensions"),
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", PLANTED], capture_output=True, text=True, timeout=300, cwd=planted / "cwd", env=env
    )
    assert done.returncode == 0, f"status {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["in_panels"] and result["worst"] < 1e-4 and result["lines"] == [], result
    assert result["library"] == str(GENUINE)
    assert str(GENUINE) in result["mapped"]
    assert not [p for p in result["mapped"] if p.startswith(str(tmp_path))], result["mapped"]
    assert result["events"] == [["ctypes.dlopen", str(GENUINE)]], result["events"]
    assert not mark.exists(), mark.read_text()
