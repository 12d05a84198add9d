"""KernelSpec: one registered description per kernel file, and what Triton compiles for a key.

A kernel file (kernels/rmsnorm.py, ...) ends with one `KernelSpec`: its `Kernel`s (one per
@triton.jit function: forward, backward), its tile policy, and its plan function (the keys of one call
site). Everything a key means to Triton is derived from the jit function itself:

    sig = jit_signature(rmsnorm_fwd_kernel)     # names, constexpr-ness, do_not_specialize, from the jit
    FWD.source(key)          # {signature, constexprs, attrs, options}: what triton.compile gets (build)
    FWD.specialization(key)  # the same, in the form Triton's binder gives for a launch (contract)
    FWD.warm(key, device)    # tiny launch that specializes exactly as `key` says (prewarm)

A Kernel declares only what the jit function cannot say: each pointer's dtype (a key parameter name,
or a literal Triton type like "fp32" / "i64"), the pointers that are fresh outputs (always 16-byte
aligned), and the ints Triton specializes on divisibility by 16 (with the key parameter holding
their value). Other arguments: `tl.constexpr` annotations are constexprs (value: the key parameter
of the same name), `do_not_specialize` ints are i32, the rest are fp32 scalars.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kdistill.dtypes import torch_dtype
from kdistill.kernels._triton import AVAILABLE
from kdistill.kernels.keys import KernelKey, arch_capability, constexpr_value, dtype_name

DIVISIBLE = [["tt.divisibility", 16]]
_LITERAL_TYPES = ("fp32", "i64", "i32", "u1", "fp8e4nv")  # pointer types named as they are, not dtypes


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of a jit function. kind: 'ptr' | 'int' | 'float' | 'constexpr'."""

    name: str
    kind: str
    specialized: bool  # Triton derives a variant from it (alignment / divisibility); False: do_not_specialize


def jit_names(jit_fn: Any) -> tuple[list[str], set[str], set[str], set[str]]:
    """(argument names, constexpr names, do_not_specialize, do_not_specialize_on_alignment) of a
    JITFunction (or the stand-in without Triton), read from the function and its decorator lists."""
    fn = getattr(jit_fn, "fn", jit_fn)
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    constexpr = {p.name for p in params if "constexpr" in str(p.annotation)}

    def as_names(items: Sequence) -> set[str]:
        return {names[i] if isinstance(i, int) else str(i) for i in items or ()}

    # under TRITON_INTERPRET=1 the jit is an InterpretedFunction, which keeps the decorator's lists in
    # its kwargs
    given = getattr(jit_fn, "kwargs", None) or {}

    def listed(attr: str) -> set[str]:
        return as_names(getattr(jit_fn, attr, None) or given.get(attr) or ())

    dns, dnsoa = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
    return names, constexpr, dns, dnsoa


@dataclasses.dataclass(eq=False)
class Kernel:
    """One @triton.jit function, its key function and its tiny warm launch.

    op: the key's op name. key(arch, **problem) -> KernelKey. launch(key, device) -> (kernel, grid,
    args, kwargs, outs): a tiny launch built through the file's own launcher that specializes as `key`.
    pointers: pointer argument -> the key parameter(s) naming its dtype (the first not None), or a
    literal Triton type. outputs: pointers that are fresh allocations. ints: specialized int arguments
    -> the key parameter holding their value.
    """

    op: str
    fn: Any
    key: Callable[..., KernelKey]
    launch: Callable[[KernelKey, Any], tuple]
    pointers: Mapping[str, str | tuple[str, ...]]
    outputs: tuple[str, ...] = ()
    ints: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def signature(self) -> tuple[Arg, ...]:
        # Read once per (kernel, jit function): every key computation asks for it, on the host's
        # critical path of a training step.
        cached = self.__dict__.get("_signature")
        if cached is not None and cached[0] is self.fn:
            return cached[1]
        sig = self._read_signature()
        self.__dict__["_signature"] = (self.fn, sig)
        return sig

    @property
    def defaults(self) -> dict[str, Any]:
        """The jit function's constexprs that have a default value: name -> value (what a launch that
        does not pass them binds, so a key may leave them out)."""
        fn = getattr(self.fn, "fn", self.fn)
        return {
            p.name: p.default
            for p in inspect.signature(fn).parameters.values()
            if p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation)
        }

    def _read_signature(self) -> tuple[Arg, ...]:
        names, constexpr, dns, dnsoa = jit_names(self.fn)
        out = []
        for n in names:
            if n in constexpr:
                out.append(Arg(n, "constexpr", True))
            elif n in self.pointers:
                out.append(Arg(n, "ptr", n not in dnsoa))
            elif n in dns or n in self.ints:
                out.append(Arg(n, "int", n not in dns))
            else:
                out.append(Arg(n, "float", False))
        return tuple(out)

    def align(self, aligned: Sequence[bool] | None = None) -> str:
        """The key's 'align' parameter: 'A' (16-byte aligned) or 'u' per alignment-specialized pointer,
        in argument order; `aligned` gives the input pointers' flags (None: all aligned), outputs are 'A'."""
        ptrs = [a.name for a in self.signature if a.kind == "ptr" and a.specialized]
        ins = [p for p in ptrs if p not in self.outputs]
        given = [True] * len(ins) if aligned is None else [bool(a) for a in aligned]
        if len(given) != len(ins):
            raise ValueError(f"{self.op}: {len(given)} alignment flags for {len(ins)} input pointers")
        flags = dict(zip(ins, given))
        return "".join("A" if flags.get(p, True) else "u" for p in ptrs)

    def _dtype(self, key: KernelKey, name: str) -> str:
        ref = self.pointers[name]
        for param in (ref,) if isinstance(ref, str) else ref:
            if param in _LITERAL_TYPES:
                return param
            if key.get(param) is not None:  # a dtype, or a literal type the key names (an int pointer)
                value = str(key[param])
                return value if value in _LITERAL_TYPES else dtype_name(value)
        raise KeyError(f"kernel key {key} has no dtype for pointer {name}")

    def source(self, key: KernelKey) -> dict[str, Any]:
        """What `key` compiles, in Triton's terms: signature {arg: '*bf16' | 'i32' | 'fp32' |
        'constexpr'}, constexprs {arg: value}, attrs {(index,): [['tt.divisibility', 16]]} and options
        {num_warps[, num_stages]}. Derived from the key alone, so a key that lacks a parameter yields a
        specialization that differs from what its launch compiles."""
        sig: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        align = key.get("align")
        defaults = self.defaults
        ptr = 0
        for i, a in enumerate(self.signature):
            if a.kind == "constexpr":
                sig[a.name] = "constexpr"
                if key.get(a.name) is not None:
                    constexprs[a.name] = constexpr_value(key[a.name])
                elif a.name in defaults:  # a constexpr with a default may be left out of a key
                    constexprs[a.name] = defaults[a.name]
            elif a.kind == "ptr":
                sig[a.name] = "*" + self._dtype(key, a.name)
                if a.specialized:
                    if align is None or (ptr < len(align) and align[ptr] == "A"):
                        attrs[(i,)] = DIVISIBLE
                    ptr += 1
            elif a.kind == "int":
                sig[a.name] = "i32"
                if a.specialized and int(key[self.ints[a.name]]) % 16 == 0:
                    attrs[(i,)] = DIVISIBLE
            else:
                sig[a.name] = "fp32"
        options = {"num_warps": int(key.get("num_warps", 4))}
        if key.get("num_stages") is not None:
            options["num_stages"] = int(key["num_stages"])
        if key.get("PDL"):
            options["launch_pdl"] = True
        return {"signature": sig, "constexprs": constexprs, "attrs": attrs, "options": options}

    def specialization(self, key: KernelKey) -> tuple:
        """source(key) as a hashable tuple, in the form `triton_specialization` gives for a launch."""
        src = self.source(key)
        out = []
        for i, a in enumerate(self.signature):
            t = src["signature"][a.name]
            if a.kind == "constexpr":
                out.append((a.name, "constexpr", src["constexprs"].get(a.name, "<missing>")))
            elif a.kind == "ptr" or (a.kind == "int" and a.specialized):
                out.append((a.name, t, "D" if (i,) in src["attrs"] else ""))
            else:
                out.append((a.name, t, None))
        return (_op_name(self.fn), tuple(out), tuple(sorted(src["options"].items())))

    def ast_source(self, key: KernelKey) -> tuple[Any, dict[str, Any]]:
        """(triton ASTSource, compile options) for `key` (the cross-arch build)."""
        from triton.compiler import ASTSource

        src = self.source(key)
        return ASTSource(self.fn, src["signature"], src["constexprs"], src["attrs"]), dict(src["options"])

    def warm(self, key: KernelKey, device: Any, dry: bool) -> tuple | None:
        """Compile `key` by a JIT warmup of its tiny launch; dry: return Triton's specialization of
        that launch instead (no compile; works on a CPU)."""
        kernel, grid, args, kwargs, _ = self.launch(key, device)
        if dry:
            return triton_specialization(kernel, args, kwargs, key.arch)
        kernel.warmup(*args, grid=grid, **kwargs)
        return None


@dataclasses.dataclass(eq=False)
class KernelSpec:
    """A kernel file's one registered description.

    name: the file's kernel name. kernels: its jit functions (forward, backward). tiles(**sizes) ->
    block sizes and warps (the tile policy; the key functions use it). plan(arch, *, grad, **call) ->
    the keys one call site launches (forward, and its backward when grad).
    """

    name: str
    kernels: tuple[Kernel, ...]
    tiles: Callable[..., dict[str, int]]
    plan: Callable[..., set[KernelKey]]


@dataclasses.dataclass(eq=False)
class LibraryOp:
    """A library call (cuBLAS GEMM, SDPA) that prewarm runs once at a planned shape; no Triton."""

    op: str
    key: Callable[..., KernelKey]
    run: Callable[[KernelKey, Any], None]

    def warm(self, key: KernelKey, device: Any, dry: bool) -> None:
        if not dry:
            self.run(key, device)


def tensor(shape: tuple[int, ...], dtype: str, device: Any, aligned: bool = True) -> torch.Tensor:
    """A zero tensor for warm launches whose data pointer is 16-byte aligned or deliberately not."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.zeros(n + 16, dtype=torch_dtype(dtype), device=device)
    return buf[:n].view(shape) if aligned else buf[1 : n + 1].view(shape)


def _op_name(jit_fn: Any) -> str:
    return getattr(jit_fn, "fn", jit_fn).__name__.removesuffix("_kernel")


_BINDERS: dict[tuple[int, int], Any] = {}


def triton_specialization(kernel: Any, args: tuple, kwargs: dict, arch: str = "sm_90") -> tuple:
    """How Triton specializes `kernel[grid](*args, **kwargs)` for `arch`, in Kernel.specialization's
    form. Works on CPU tensors: only data pointers, dtypes and values are looked at."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    cap = arch_capability(arch)
    ident = (id(kernel), cap)
    if ident not in _BINDERS:
        backend = make_backend(GPUTarget("cuda", cap, 32))
        _BINDERS[ident] = create_function_from_signature(kernel.signature, kernel.params, backend)
    _bound, spec, options = _BINDERS[ident](*args, **kwargs)
    out = []
    for param, (ty, attr) in zip(kernel.params, spec):
        if ty == "constexpr":
            out.append((param.name, "constexpr", attr))
        elif ty.startswith("*"):
            out.append((param.name, ty, attr or ""))
        else:
            out.append((param.name, ty, attr))
    opts = options if isinstance(options, dict) else dict(getattr(options, "__dict__", {}))
    return (
        _op_name(kernel),
        tuple(out),
        tuple(
            sorted(
                (k, v)
                for k, v in opts.items()
                if k in ("num_warps", "num_stages") or (k == "launch_pdl" and v)
            )
        ),
    )


__all__ = [
    "AVAILABLE",
    "Arg",
    "Kernel",
    "KernelSpec",
    "LibraryOp",
    "jit_names",
    "tensor",
    "triton_specialization",
]
