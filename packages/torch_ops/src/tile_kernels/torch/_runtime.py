"""Executes core Plans on torch tensors, and routes a call either straight to its kernels (eager) or through the
registered op (torch.compile, DTensor, fake tensors, dispatch modes).

Two ways to one set of kernels:
- eager, plain tensors: `Executor` runs a Plan cached per call signature, each compiled Triton kernel launched through
  its bound launcher (Triton's `CompiledKernel.run`, specialized per pointer alignment), autograd through a plain
  `torch.autograd.Function`. This is what a PyTorch user calling the op pays for: one Python layer over the launches.
- everything else: the registered `torch.library` op (triton_op / custom_op), whose body is the same function;
  under tracing its launches go through `wrap_triton`, so torch.compile sees the kernels.
On CPU tensors the kernels run in Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import functools
import inspect
import math
import operator

import torch
from torch._functorch import config as functorch_config
from torch.library import custom_op, triton_op, wrap_triton
from triton import knobs

from tile_kernels.core import Plan, Target
from tile_kernels.core.backends import Call
from tile_kernels.core.host import interpreter_hint, interpreting, poisoning
from tile_kernels.core.plan import Gemm, Rows, is_ref

_LIBRARY = torch.library.Library("tile_kernels", "FRAGMENT")
_INTERPRETING = interpreting()  # Triton reads the switch at import, so it cannot change later either

if _INTERPRETING and hasattr(functorch_config, "decompose_custom_triton_ops"):
    # AOTAutograd would trace the triton ops' bodies with fake tensors, on which the interpreter launches nothing
    # (the Executor returns the unwritten buffers): a compiled graph would return uninitialized memory. Kept as graph
    # nodes, the ops run the interpreted kernels when the graph runs.
    functorch_config.decompose_custom_triton_ops = False

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_POISON = poisoning()  # read once, as Triton reads its switch
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_transforms = torch._C._are_functorch_transforms_active
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def eager_op(name: str, impl, setup_context=None, backward=None, mutates_args=(), register=triton_op):
    """Registers `impl` as the triton_op tile_kernels::<name> (`register`: custom_op for compiled_op's; with
    `backward` as its autograd, when given) and returns its call: `impl(*args)` directly in eager mode (not tracing
    under torch.compile or fake tensors, no dispatch mode or functorch transform that must see the op, no tensor
    subclass such as DTensor), through an autograd.Function made of the same `setup_context` / `backward` when a
    gradient is wanted; the registered op otherwise. Both ways differentiate alike. The call's `.register_fake` is
    the op's. The direct call bumps the version counters of the `mutates_args` tensors, as the op's dispatch does (a
    saved tensor written since it was saved is then refused by autograd, not read)."""
    op = register(f"tile_kernels::{name}", mutates_args=mutates_args)(impl)
    mutated = [i for i, arg in enumerate(inspect.signature(impl).parameters) if arg in mutates_args]
    apply = None  # a filled closure cell: triton_op inspects the closures of the functions its body calls
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)

        def forward(ctx, *args):
            out = impl(*args)
            setup_context(ctx, args, out)
            return out

        function = type(name, (torch.autograd.Function,),
                        {"forward": staticmethod(forward), "backward": staticmethod(backward)})  # fmt: skip
        # Function.apply without its Python layer (default-argument binding, unwrapping dead functorch wrappers):
        # the call below sends functorch's tensors to the op, and the class has no setup_context to bind for
        apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)

    def call(*args):
        if _compiling() or _dispatch_modes() or _functorch_transforms():
            return op(*args)
        wants_grad = False
        for a in args:  # a tensor subclass (DTensor) or a functorch wrapper goes to the op; does a tensor want a grad
            if isinstance(a, torch.Tensor):
                if type(a) not in _PLAIN or _functorch_wrapped(a):
                    return op(*args)
                wants_grad = wants_grad or a.requires_grad
        if wants_grad and apply is not None and torch.is_grad_enabled():
            return apply(*args)
        out = impl(*args)
        if mutated:
            torch.autograd.graph.increment_version([args[i] for i in mutated])
        return out

    call.register_fake = op.register_fake
    call.__name__ = call.__qualname__ = name
    call.__doc__ = impl.__doc__
    return call


def plain_eager(*tensors: torch.Tensor) -> bool:
    """Whether a call on `tensors` runs on plain tensors in eager mode (eager_op's direct way): not tracing under
    torch.compile, no dispatch mode or functorch transform, no tensor subclass (DTensor) or functorch wrapper."""
    if _compiling() or _dispatch_modes() or _functorch_transforms():
        return False
    return all(type(t) in _PLAIN and not _functorch_wrapped(t) for t in tensors)


def compiled_op(name: str):
    """Decorator: eager_op for `impl`, a call of TVM-FFI compiled functions (opaque to torch.compile), registered as
    the custom op tile_kernels::<name>: run directly in eager mode (custom op dispatch costs host time a call), the
    op otherwise; `.register_fake` registers its fake implementation."""
    return lambda impl: eager_op(name, impl, register=custom_op)


def register_public_op(schema: str, fn) -> None:
    """torch.ops.tile_kernels.<name>: the public function as a composite op, differentiable through the _fwd op's
    registered autograd."""
    _LIBRARY.define(schema)
    _LIBRARY.impl(schema.split("(")[0], fn, "CompositeImplicitAutograd")


def check_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    """All tensors torch tensors on one device, and that device can run the kernels. Returns the device."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if device is None:
            device = t.device
        elif t.device != device:
            where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items() if t is not None)
            raise ValueError(f"{op}: all tensors must be on one device, got {where}")
    if device.type == "cuda":
        return device
    if device.type == "cpu":
        if _INTERPRETING:
            return device
        raise ValueError(
            f"{op}: got CPU tensors; the kernels run on CUDA/ROCm devices, or on the CPU in Triton's interpreter "
            f"({interpreter_hint()})"
        )
    raise ValueError(
        f"{op}: tensors must be on a CUDA/ROCm device, or on the CPU in Triton's interpreter ({interpreter_hint()}); "
        f"got {device}"
    )


_VALIDATED: dict = {}  # call signature -> (check's result, device), of calls that passed
_SCALARS = (int, float, bool, str, type(None))


def validated(op: str, check, names: tuple[str | None, ...], *args):
    """(check(*args), device): an op's core validation and check_device of the arguments `names` labels (tensors or
    None), once per call signature. Each check reads only the tensors' types, dtypes, shapes and devices and the
    other arguments' types and values, so a signature that passed once passes again. Not cached while tracing (sizes
    may be symbolic) or with an argument other than a tensor, a scalar or a tuple of scalars."""
    key = None if _compiling() else _signature(check, args)
    if key is not None and (hit := _VALIDATED.get(key)) is not None:
        return hit
    result = check(*args), check_device(op, **{n: a for n, a in zip(names, args, strict=True) if n is not None})
    if key is not None and len(_VALIDATED) < 4096:
        _VALIDATED[key] = result
    return result


def _signature(check, args) -> tuple | None:
    key = [check]
    for a in args:
        kind = type(a)
        if kind in _PLAIN:
            key.append((kind, a.dtype, a.shape, a.device))
        elif kind in _SCALARS:
            key.append((kind, a))
        elif kind is tuple and all(type(e) in _SCALARS for e in a):
            key.append((kind, tuple((type(e), e) for e in a)))
        else:
            return None
    return tuple(key)


@functools.cache
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    warp = getattr(props, "warp_size", 64 if torch.version.hip else 32)
    cuda_arch = 0 if torch.version.hip else props.major * 10 + props.minor
    return Target(warp_size=warp, num_sms=props.multi_processor_count, cuda_arch=cuda_arch)


_CPU_TARGET = Target()  # the interpreter's


def target(device: torch.device) -> Target:
    if device.type == "cpu":
        return _CPU_TARGET
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def as_rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """(t', rows, row stride): t' holds t's elements as rows of n at one row stride with unit column stride, as the
    kernels address them: t itself when contiguous (the kernels see only its pointer), else a (rows, n) view, or a
    copy when no such view exists."""
    rows = math.prod(t.shape[:-1])
    if t.is_contiguous():
        return t, rows, n
    t2 = t.reshape(rows, n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2, rows, t2.stride(0) if rows > 1 else n


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with unit last-dim stride (copied only if it has none): what kernels reading rows of any stride need."""
    return t.contiguous() if t.shape[-1] > 1 and t.stride(-1) != 1 else t


@functools.lru_cache(maxsize=4096)
def _cached_executor(builder, *args, **kwargs) -> Executor:
    return Executor(builder(*args, **kwargs))


def executor(builder, *args, **kwargs) -> Executor:
    """The Executor of the Plan `builder(*args, **kwargs)`, cached per arguments (plans are pure functions of them);
    built anew when an argument is unhashable (symbolic sizes while torch.compile traces)."""
    try:
        return _cached_executor(builder, *args, **kwargs)
    except TypeError:
        return Executor(builder(*args, **kwargs))


_COMPACT_RUNS: dict = {}  # compact_key -> the Executor of that call


def compact_key(op, *tensors: torch.Tensor) -> tuple | None:
    """A key for a call of `op` whose tensors are all contiguous, outside tracing: such a call's plan arguments
    (rows, row strides) follow from the op, the shapes, dtypes and device alone, so its Executor can be found in one
    dict lookup (compact_run) instead of as_rows, dtype names, target and executor's keyed cache. None otherwise."""
    if _compiling():
        return None
    key = [op, tensors[0].device]
    for t in tensors:
        if not t.is_contiguous():
            return None
        key += (t.shape, t.dtype)
    return tuple(key)


def compact_run(key: tuple | None, run: Executor | None = None) -> Executor | None:
    """The Executor stored under compact_key `key` (None if none or no key); with `run`, stores it (up to 4096)."""
    if key is None:
        return None
    try:
        if run is None:
            return _COMPACT_RUNS.get(key)
        if len(_COMPACT_RUNS) < 4096:
            _COMPACT_RUNS[key] = run
    except TypeError:  # symbolic sizes do not hash
        pass
    return run


class Executor:
    """Runs one Plan over a flat list of tensors: the inputs, the buffers it allocates, the views of buffer rows its
    steps name (`Rows`, made once a call), then its launches' scalar arguments; each step picks its arguments from
    that list by positions resolved once, when the Executor was built."""

    def __init__(self, plan: Plan):
        self.plan = plan
        names = (*plan.inputs, *plan.buffers)
        self.buffers = [(n, s.shape, getattr(torch, s.dtype), s.zeroed) for n, s in plan.buffers.items()]
        self.views: list[tuple[int, int, int]] = []  # (slot, start, stop) of each use of a Rows reference
        self.constants: list = []  # the launches' scalar arguments, after the views
        slots = {name: i for i, name in enumerate(names)}

        def slot(ref) -> int:
            if not isinstance(ref, Rows):
                return slots[ref]
            self.views.append((slots[ref.name], ref.start, ref.stop))  # one a use: symbolic bounds do not hash
            return len(names) + len(self.views) - 1

        kinds = {Gemm: _GemmStep, Call: _CallStep}
        self.steps = [kinds.get(type(s), _LaunchStep)(s, slot) for s in plan.launches]
        base = len(names) + len(self.views)
        for step in self.steps:  # the launches' scalars, known once every step has named its views
            if isinstance(step, _LaunchStep):
                step.bind_constants(base + len(self.constants), len(plan.inputs), len(names))
                self.constants += step.constants
        self.pick_outputs = picker([slots[name] for name in plan.outputs])
        self.launches_bound = not _INTERPRETING and any(isinstance(s, _LaunchStep) for s in self.steps)

    def __call__(self, *inputs: torch.Tensor, device: torch.device, shapes=None) -> tuple[torch.Tensor, ...]:
        """Runs the plan on `inputs` (tensors whose pointers the kernels read: any shape with the plan's layout).
        shapes: {buffer name: shape, or a tensor of that shape} to allocate buffers in (the caller's shapes, the same
        elements), the plan's shapes otherwise; a buffer given a contiguous tensor of its dtype is allocated like it
        (torch.empty_like: a third of torch.empty's host time)."""
        tensors = list(inputs)
        for name, shape, dtype, zeroed in self.buffers:
            tensors.append(allocate(shape if shapes is None else shapes.get(name, shape), dtype, zeroed, device))
        for i, start, stop in self.views:
            tensors.append(tensors[i][start:stop])
        real = type(inputs[0]) in _PLAIN  # real tensors (an op's body traced by torch.compile sees fake ones)
        # the same list with each tensor's address: what the bound launchers take (see _LaunchStep)
        addresses = [t.data_ptr() for t in tensors] + self.constants if real and self.launches_bound else None
        tensors += self.constants
        if real:
            for step in self.steps:
                step.run(tensors, addresses, device)
        elif not _INTERPRETING:  # tracing: the kernels as graph nodes
            for step in self.steps:
                step.trace(tensors)
        # tracing on the CPU: shapes only (the interpreter cannot run on fake tensors; the ops stay graph nodes)
        return self.pick_outputs(tensors)


def picker(positions: list[int]):
    """operator.itemgetter(*positions), returning a tuple for any number of positions."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        pick = operator.itemgetter(positions[0])
        return lambda items: (pick(items),)
    return lambda items: ()


def allocate(like, dtype: torch.dtype, zeroed: bool, device) -> torch.Tensor:
    """A plan buffer of the shape `like` (a shape, or a tensor whose shape to take): zeros when the plan says so, else
    uninitialized (NaN under TILE_KERNELS_POISON=1)."""
    if isinstance(like, torch.Tensor):
        if not (zeroed or _POISON) and like.dtype == dtype and like.is_contiguous():
            return torch.empty_like(like)
        like = like.shape
    # size= as a keyword: torch's argument parser takes it in half the time of a positional shape
    if zeroed:
        return torch.zeros(size=like, dtype=dtype, device=device)
    if _POISON and dtype.is_floating_point:
        return torch.full(size=like, fill_value=float("nan"), dtype=dtype, device=device)
    return torch.empty(size=like, dtype=dtype, device=device)


class _LaunchStep:
    """One Triton launch. On a GPU the compiled kernel is called through its bound launcher (what
    `JITFunction.run` ends in, without re-binding and re-specializing the arguments on every call): bound per device,
    for calls whose pointers are all 16-byte aligned. Pointer alignment is the one property of a call's tensors that
    Triton specializes on and a cached plan does not fix (their dtypes, the ints and the constexprs are the plan's);
    a call with a misaligned pointer goes through Triton's own launch, which specializes per pointer. Only inputs and
    views of buffer rows can be misaligned: the buffers are the allocator's (512-byte aligned).
    The bound launcher gets each pointer as its address (an int): given a tensor, Triton's launcher would call its
    data_ptr() and validate it with a driver query (cuPointerGetAttribute), pointer by pointer, at every launch; the
    adapter has checked the devices already."""

    def __init__(self, launch, slot):
        self.launch = launch
        names = launch.reads + launch.writes
        # an absent pointer gets a buffer the kernel writes anyway (never dereferenced; trace gives it its own)
        refs = [a for a in launch.writes if is_ref(a)] or [a for a in launch.reads if is_ref(a)]
        anchor = slot(refs[0])
        self.constants = [a for a in names if not (is_ref(a) or a is None)]
        self.positions = [slot(a) if is_ref(a) else anchor if a is None else None for a in names]
        self.absent = [i for i, a in enumerate(names) if a is None]
        kernel = launch.kernel
        self.grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        self.options = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
        # torch.compile's wrap_triton launches without PDL: the kernel's gdc calls (a PDL constexpr gates them) are
        # compiled out there, as their inline asm would stop torch.compile's analysis of what the kernel writes
        self.traced_options = dict(self.options) | ({"PDL": False} if "PDL" in launch.constexprs else {})
        if launch.pdl and not _INTERPRETING:
            self.options["launch_pdl"] = True  # compiled into the kernel's launcher metadata: the bound path too
        self.bound: dict = {}
        if not _INTERPRETING:  # the bound launcher takes every parameter: the constexprs follow the others (plan.py)
            defaults = {p.name: p.default for p in kernel.params}
            self.constexprs = tuple(launch.constexprs.get(n, defaults[n]) for n in kernel.arg_names[len(names) :])

    def bind_constants(self, first: int, inputs: int, buffers_end: int) -> None:
        """The step's scalars sit at `first`... of the Executor's list; slots below `inputs` are inputs and slots from
        `buffers_end` on (before the scalars) views: the tensors whose alignment a call checks."""
        constant = iter(range(first, first + len(self.constants)))
        positions = [next(constant) if p is None else p for p in self.positions]
        self.arguments = picker(positions)
        self.unaligned_candidates = picker(sorted({p for p in positions if p < inputs or buffers_end <= p < first}))

    def run(self, tensors, addresses, device):
        """Launches on the tensors of the Executor's list; `addresses`: the same list with the tensors' addresses
        (None in the interpreter)."""
        kernel = self.launch.kernel
        if _INTERPRETING:
            kernel[self.grid](*self.arguments(tensors), **self.options)
            return
        index = device.index
        current = _current_device()
        if index is None:  # "cuda": the current device
            index = current
        elif index != current:  # Triton compiles, loads and launches on the current device
            with torch.cuda.device(index):
                return self.run(tensors, addresses, device)
        misaligned = 0
        for address in self.unaligned_candidates(addresses):
            misaligned |= address
        key = (index, misaligned & 15 == 0)  # every pointer 16-byte aligned (the common case), or not all
        bound = self.bound.get(key)
        if bound is None or not key[1] or _profiled():  # first call (compiles), misaligned pointers, a profiler
            compiled = kernel[self.grid](*self.arguments(tensors), **self.options)  # specializes on each pointer
            if key[1]:
                self.bound[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = bound
        run(*self.grid, _stream(index), function, metadata, None, None, None, *self.arguments(addresses),
            *self.constexprs)  # fmt: skip

    def trace(self, tensors):
        """The launch as a graph node. An absent pointer gets a 1-element tensor of its own: where torch.compile
        cannot analyze a kernel (inline asm) it counts every pointer as written and functionalizes each argument
        separately, so a stand-in aliasing a written buffer would put that buffer's old contents back after the
        launch."""
        args = list(self.arguments(tensors))
        for i in self.absent:
            args[i] = args[i].new_empty(1)
        wrap_triton(self.launch.kernel)[self.grid](*args, **self.traced_options)


class _CallStep:
    """One TVM-FFI call of a compiled TileLang or CUDA C++ function (tile_kernels.core.backends.Call): the tensors
    passed directly (DLPack, no copies), run on torch's current stream; the function loaded (built on first use) at
    the first run, where a build error surfaces. torch.compile cannot trace these calls: the ops that make them are
    custom ops with fake implementations."""

    def __init__(self, call: Call, slot):
        self.load, self.function = call.load, None
        self.args = [slot(name) for name in call.reads + call.writes]
        self.attrs = tuple(call.attrs.values())

    def run(self, tensors, addresses=None, device=None):
        if self.function is None:
            self.function = self.load()
        self.function(*(tensors[i] for i in self.args), *self.attrs)


class _GemmStep:
    """torch's matmul (cuBLAS / hipBLAS: fp32 accumulation) into the plan's buffer; += through addmm's beta = 1."""

    def __init__(self, gemm: Gemm, slot):
        self.gemm = gemm
        self.a, self.b, self.out = slot(gemm.a), slot(gemm.b), slot(gemm.out)

    def run(self, tensors, addresses=None, device=None):
        a, b, out = tensors[self.a], tensors[self.b], tensors[self.out]
        a, b = a.t() if self.gemm.trans_a else a, b.t() if self.gemm.trans_b else b
        if self.gemm.accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)

    trace = run


# torch.cuda.current_device without its lazy-initialization check: a launch's tensors are on an initialized device
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


def _profiled() -> bool:
    """A launch hook is set (a profiler such as Proton): launches then go through Triton's own path, which calls it."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))  # Triton 3.6+: a chain of hooks, empty when unused
