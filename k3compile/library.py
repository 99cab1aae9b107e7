"""A compiled library and its weights file, as `compile` and `export --mesh` write them and every runtime reads them
(docs/architecture.md, "What an artifact is"; the trust model: README, "Trust").

`model.so` is native code: loading it runs whatever it holds (an artifact is a program, as an executable is). What
this module adds is that a library says what it takes and that a damaged one is refused before it is mapped:
- the signature: at compile time `with_signature` adds to the Relax module a function `k3compile_signature` that
  returns, as a constant, the JSON list of main's weight parameters in order — [name, shape, dtype] each, as they
  were compiled. `load` reads it back and checks it against the names the manifest gives and the entries of the
  weights file (`read_weights`), so a manifest whose `params` were permuted (each still naming a tensor of the same
  shape) or a weights file of another build is refused instead of decoding other tokens;
- the ELF check: a library is an ELF shared object whose every program segment and the section table lie inside the
  file; a truncated one (the file cut short, then its hash recorded again) would fault (SIGBUS) as the loader maps
  it, with no message: it is refused by name first.
Readers import this module, never the compiler.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from k3compile.interface import ExportError

SIGNATURE_FUNC = "k3compile_signature"
# The entry points with MLA's caches kept in place (passes/inplace_caches.py makes them; backends/tvm.py and lean.py
# call them): main_inplace, and main_inplace returning each row's last-position logits only.
INPLACE_FUNC = "main_inplace"
LAST_FUNC = "main_inplace_last"
# A step whose attention is at least this many (token, position) pairs gives its intermediates back to the system
# afterwards (release_pool): the VM's pooled allocator keeps every block it freed for a later request of the same
# size, and the steps of a chunked prefill each take new sizes (their cache is longer), so the pool grew by every
# chunk's intermediates: 14 GB over a 32k-token prompt in 2048-token chunks on k3-tiny, with the peak of one chunk
# ~1 GB.
RELEASE_AT = 1 << 22
# what compile writes (numpy can view each through DLPack): safetensors dtype -> (TVM dtype, bytes)
SAFETENSORS_DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "F64": ("float64", 8), "U8": ("uint8", 1),
                      "I8": ("int8", 1), "I32": ("int32", 4), "U16": ("uint16", 2), "U32": ("uint32", 4),
                      "I64": ("int64", 8),
                      "BOOL": ("bool", 1)}
HEADER_MAX = 100 * 2**20  # the safetensors format's own bound on the JSON header


def signature_of(mod, names: list[str]) -> list:
    """[[name, shape, dtype], ...] of main's weight parameters (after its graph inputs), as compiled."""
    main = mod["main"]
    params = main.params[int(main.attrs["num_input"]):]
    if len(params) != len(names):
        raise ExportError(f"main takes {len(params)} weights, {len(names)} names given")  # a bug, not the user's
    return [[n, [int(d) for d in p.ty.shape], str(p.ty.dtype)] for n, p in zip(names, params)]


def with_signature(mod, names: list[str]):
    """`mod` with the function that returns its signature (a uint8 constant of the JSON), for a CPU build."""
    from tvm import relax

    data = np.frombuffer(json.dumps(signature_of(mod, names)).encode(), np.uint8)
    func = relax.Function([], relax.const(data), ret_ty=relax.TensorType([data.size], "uint8"))
    mod = mod.clone()  # the caller keeps its module as it was
    mod[SIGNATURE_FUNC] = func.with_attr("global_symbol", SIGNATURE_FUNC)
    return mod


def transform_weights(executable, raw: list) -> list:
    """Run a CPU build's `main_transform_params` on the raw weights (their layout for the target). `executable`:
    the compiled module, or (before it is shipped) the library file it was exported to, loaded: a VM made on an
    executable that is exported afterwards leaves an empty memory scope per constant in the file (TVM 0.27, vm.cc),
    which every load then prints ("Scope Saving:", "Scope Loaded:"); so writers export first, then transform."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(executable, tvm.cpu())
    return list(vm["main_transform_params"](list(raw)))


def check_elf(path: Path) -> None:
    """Refuse a file that is not a whole 64-bit little-endian ELF shared object (segments and sections in the file)."""
    def bad(why: str) -> ExportError:
        return ExportError(f"{path}: not a loadable library ({why}; compile again)")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF":
                raise bad("no ELF header")
            if head[4] != 2 or head[5] != 1:
                raise bad("not a 64-bit little-endian ELF file")
            e_type, = struct.unpack_from("<H", head, 16)
            phoff, shoff = struct.unpack_from("<QQ", head, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
            if e_type != 3:  # ET_DYN
                raise bad("not a shared object")
            if phnum == 0 or phentsize < 56 or phoff + phnum * phentsize > size:
                raise bad("program headers outside the file")
            if shnum and shoff + shnum * shentsize > size:
                raise bad("truncated: its section table lies past the end")
            f.seek(phoff)
            table = f.read(phnum * phentsize)
            for i in range(phnum):
                p_type, _, p_offset = struct.unpack_from("<IIQ", table, i * phentsize)
                p_filesz, = struct.unpack_from("<Q", table, i * phentsize + 32)
                if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
                    raise bad("truncated: a loadable segment lies past the end")
    except OSError as e:
        raise ExportError(f"{path}: unreadable ({e.strerror or e})") from None


def load(path: Path, names: list[str] | None = None, weights: Path | None = None):
    """The library at `path` (ELF-checked first); with `names` (the manifest's params) its signature must give those
    names, and with `weights` every named tensor of that file the compiled shape and dtype. Returns the module."""
    import tvm

    from k3compile import host_gemm

    path = Path(path)
    check_elf(path)
    host_gemm.register()  # what a CPU library calls for prefill rows (targets/llvm.py)
    try:
        module = tvm.runtime.load_module(str(path))
    except Exception as e:  # TVM's loader raises its own error types for a bad library
        raise ExportError(f"{path}: cannot load it ({str(e).splitlines()[0][:200]})") from None
    if names is not None:
        check_signature(path, signature(module, path), names, weights)
    return module


def signature(module, path: Path) -> list:
    """What the library says it takes (with_signature), read through a VM on this CPU."""
    import tvm
    from tvm.runtime.vm import VirtualMachine  # the runtime's: no compiler needed (lean.py)

    try:
        vm = VirtualMachine(module, tvm.cpu())
        doc = json.loads(vm[SIGNATURE_FUNC]().numpy().tobytes())
    except Exception:  # no such function (an older build), or not a k3compile library
        raise ExportError(f"{path}: carries no k3compile signature (built by an older k3compile, or not by "
                          "k3compile); compile again") from None
    if not (isinstance(doc, list) and all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                                          for e in doc)):
        raise ExportError(f"{path}: its signature is malformed; compile again")
    return doc


def check_signature(path: Path, sig: list, names: list[str], weights: Path | None = None) -> None:
    if [e[0] for e in sig] != list(names):
        diff = next((i for i, (e, n) in enumerate(zip(sig, names)) if e[0] != n), min(len(sig), len(names)))
        got = names[diff] if diff < len(names) else "nothing"
        want = sig[diff][0] if diff < len(sig) else "nothing"
        raise ExportError(f"{path}: was compiled to take {want!r} as weight {diff}, the manifest gives {got!r} "
                          "(the manifest was edited, or the library is another build's); compile again")
    if weights is None:
        return
    header = read_header(weights)
    for name, shape, dtype in sig:
        ent = header.get(name)
        stored = SAFETENSORS_DTYPES.get(ent.get("dtype"), ("?",))[0] if isinstance(ent, dict) else None
        if not isinstance(ent, dict) or ent.get("shape") != shape or stored != dtype:
            have = "missing" if not isinstance(ent, dict) else f"{ent.get('shape')} {stored}"
            raise ExportError(f"{weights}: weight {name!r} is {have}, the library was compiled for {shape} {dtype} "
                              "(weights of another build); compile again")


def read_header(path: Path) -> dict:
    """The safetensors JSON header of a weights file, bounds-checked."""
    return _header(Path(path))[0]


def _unreadable(path: Path, why: str) -> ExportError:
    return ExportError(f"{path}: not a readable weights file ({why}; compile again)")


def _header(path: Path) -> tuple[dict, int, int]:
    """(header, header length, file size)."""
    def bad(why: str) -> ExportError:
        return _unreadable(path, why)

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise bad("truncated")
            n = struct.unpack("<Q", head)[0]
            if n > min(HEADER_MAX, size - 8):
                raise bad("header length out of range")
            try:
                header = json.loads(f.read(n))
            except (ValueError, UnicodeDecodeError):
                raise bad("header is not JSON") from None
    except OSError as e:
        raise ExportError(f"{path}: unreadable ({e.strerror or e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a table")
    return header, n, size


def read_weights(path: Path, names: list[str], device) -> list:
    """The named tensors of a safetensors file, each read straight into TVM memory (no numpy copy, no memory map:
    the peak resident memory is the weights once plus the process)."""
    import tvm

    def empty(shape, dtype):
        t = tvm.runtime.empty(shape, dtype, device)
        return t, np.from_dlpack(t)

    return list(read_tensors(path, names, empty))


def read_tensors(path: Path, names: list[str], empty=None):
    """Yield the named tensors of a safetensors file in order, each read into the buffer `empty(shape, dtype)`
    returns as (tensor, its writable numpy view) (default: a numpy array), one at a time: no memory map, so the file
    is never resident as a whole. The format: an 8-byte little-endian header length, a JSON header {name: {dtype,
    shape, data_offsets: [begin, end]}} (offsets after the header), the data. The file's sha256 was checked against
    the manifest already; every entry is still checked before its buffer is allocated."""
    import math

    path = Path(path)
    header, n, size = _header(path)
    if empty is None:
        def empty(shape, dtype):
            a = np.empty(shape, dtype)
            return a, a

    def bad(why: str) -> ExportError:
        return _unreadable(path, why)

    try:
        with open(path, "rb") as f:
            for name in names:
                ent = header.get(name)
                if not isinstance(ent, dict):
                    raise ExportError(f"{path}: missing the weight {name!r} the library takes")
                dtype, shape, offsets = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
                if (not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES or not isinstance(shape, list)
                        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                        or not (isinstance(offsets, list) and len(offsets) == 2
                                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets))):
                    raise bad(f"entry {name!r} malformed")
                np_dtype, itemsize = SAFETENSORS_DTYPES[dtype]
                begin, end = offsets
                if not (0 <= begin <= end and 8 + n + end <= size
                        and end - begin == itemsize * math.prod(shape)):  # checked before any allocation
                    raise bad(f"entry {name!r} out of range")
                t, view = empty(shape, np_dtype)
                f.seek(8 + n + begin)
                if view.nbytes and f.readinto(memoryview(view.reshape(-1)).cast("B")) != view.nbytes:
                    raise bad("truncated")
                yield t
    except OSError as e:
        raise ExportError(f"{path}: unreadable ({e.strerror or e})") from None


def release_pool() -> None:
    """Free the blocks TVM's pooled allocators hold for reuse (tensors in use are not touched)."""
    import tvm

    tvm.get_global_func("vm.builtin.memory_manager.clear")()


def runtime_only() -> bool:
    """Whether this process's tvm is TVM's runtime library alone (lean.import_tvm): no compiler, no LLVM."""
    from tvm import base

    return bool(getattr(base, "_RUNTIME_ONLY", False))


def has_function(vm, name: str) -> bool:
    """Whether the VM's library has function `name`."""
    try:
        vm[name]
    except (AttributeError, KeyError, ValueError, RuntimeError):
        return False
    return True


def open_artifact(folder: Path):
    """A compiled artifact's manifest (every file's sha256 checked: manifest.read_manifest) and config, which must
    give the interface the manifest records; before its host is checked and anything is loaded."""
    from k3compile.config import read_config
    from k3compile.interface import GraphInterface
    from k3compile.manifest import read_manifest

    manifest = read_manifest(folder)
    config = read_config(folder / "config.json")
    if manifest.get("interface") != GraphInterface.of(config).as_record():
        raise ExportError(f"{folder}: config.json does not give the interface its manifest records")
    return manifest, config


def load_artifact(folder: Path, manifest: dict, device) -> tuple:
    """(library, decode library or None, weights on `device`): what TvmBackend and lean.LeanArtifact run. The decode
    library is the batch-1, static-shape one `compile --tune` adds (manifest "tuning"; k3compile/tune.py), on the
    same weights; each library's signature is checked against the weights file (`load`)."""
    from k3compile.manifest import LIBRARY, WEIGHTS

    names = manifest["params"]
    executable = load(folder / LIBRARY, names, folder / WEIGHTS)
    tuning = manifest.get("tuning")
    decode = load(folder / tuning["library"], names, folder / WEIGHTS) if tuning else None
    return executable, decode, read_weights(folder / WEIGHTS, names, device)


def vm_for(vm, decode_vm, ids_shape: tuple) -> object:
    """The decode library's VM for a batch-1 decode step (ids [1, 1]) where there is one, else the library's."""
    return decode_vm if decode_vm is not None and tuple(ids_shape) == (1, 1) else vm
