"""Where one training step's time goes, per class of work, and how close each matmul-like class runs to the peak.

``xeonsd train --profile_step N`` records step N with ``torch.profiler`` and the first step's FLOPs per op with
``torch.utils.flop_counter`` (``--count_flops``); this module maps both to the classes of :data:`CLASSES` with
one pure function, :func:`classify_op`, so a step's time and its FLOPs are split the same way. ``xeonsd bench
train --profile`` divides each matmul-like class's FLOPs by its time and by the matmul peak it measured in the
same run. The memory-bound classes (norms and elementwise ops, the optimizer, the rest) get their time and share
of the step: they have no matmul peak to be measured against, and the profiler does not record their bytes.

How an op is classed: the nearest classified op around it (itself first) names its class, so the ``aten::empty``
inside a convolution is convolution time, while the casts autocast makes inside ``aten::conv2d`` (``aten::to``)
are elementwise time: what casting every step costs shows as such. Anything inside ``Optimizer.step`` or
``Optimizer.zero_grad`` is the optimizer's. Time is each op's self time, so every microsecond is counted once; what the step spent outside
any op (Python, the data, the profiler itself) is :data:`OUTSIDE`, so that the classes add up to the step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

ATTN_FWD, ATTN_BWD, CONV, MATMUL, ELEMENTWISE, OPTIMIZER, OTHER, OUTSIDE = (
    "attention forward",
    "attention backward",
    "convolutions",
    "matmuls",
    "norms + elementwise",
    "optimizer",
    "other ops",
    "not in an op",
)
CLASSES = (ATTN_FWD, ATTN_BWD, CONV, MATMUL, ELEMENTWISE, OPTIMIZER, OTHER, OUTSIDE)
#: The classes whose FLOPs are counted and compared with the matmul peak of the step's dtype.
MATMUL_LIKE = (ATTN_FWD, ATTN_BWD, CONV, MATMUL)

# op names as word lists (a list literal would be laid out one name a line)
_MATMULS = frozenset(
    "mm addmm bmm baddbmm matmul linear addmv mv einsum _addmm_activation mkldnn_linear dot addbmm".split()  # noqa: SIM905
)
_ELEMENTWISE = frozenset(
    """
    add sub mul div neg pow sqrt rsqrt exp log abs sign clamp clamp_min clamp_max maximum minimum where lerp
    addcmul addcdiv silu gelu relu sigmoid tanh softmax _softmax log_softmax _log_softmax dropout native_dropout
    mean sum mse_loss copy to _to_copy clone contiguous cat stack fill zero zeros_like ones_like cos sin erf
    square reciprocal upsample_nearest2d _unsafe_view_copy rsub index_select embedding embedding_dense_backward
    pad constant_pad_nd threshold_backward silu_backward gelu_backward sigmoid_backward tanh_backward
    mse_loss_backward norm
    """.split()  # noqa: SIM905
)
_CONV = re.compile(r"conv(olution|\d|_transpose|_depthwise)|convolution")
_BACKWARD_NODE = re.compile(r"^(?P<base>\w+?)Backward\d*$")


def op_base(name: str) -> str:
    """The op's bare name: ``aten::addmm``, ``aten.addmm.default`` and ``aten.addmm`` are ``addmm``; an autograd
    node's evaluation (``autograd::engine::evaluate_function: AddmmBackward0``) is ``AddmmBackward0``."""
    name = name.strip()
    if ": " in name:
        name = name.rsplit(": ", 1)[1]
    for prefix in ("aten::", "aten.", "prims::", "prims.", "mkldnn::", "quantized::"):
        if name.startswith(prefix):
            name = name[len(prefix) :].split(".", 1)[0]
            break
    return name


def classify_op(name: str) -> str | None:
    """The class of work of one op or profiler range by its name alone (None: it says nothing, e.g. a view, an
    allocation, a range around the whole step). Pure: the profile and the FLOP counts are both split by it."""
    if name.startswith(("Optimizer.step", "Optimizer.zero_grad")):
        return OPTIMIZER
    base = op_base(name)
    lower = base.lower()
    node = _BACKWARD_NODE.match(base)
    if "scaled_dot_product" in lower or "scaleddotproduct" in lower or "flash_attention" in lower:
        return ATTN_BWD if ("backward" in lower or node) else ATTN_FWD
    if _CONV.search(lower):
        return CONV
    if node:  # an autograd node: its forward op's class (AddmmBackward0 → addmm, MulBackward0 → mul)
        stem = re.sub(r"(?<!^)([A-Z])", r"_\1", node["base"]).lower()
        return classify_op(stem) or classify_op(stem.removeprefix("native_"))
    stem = lower.rstrip("_")
    if stem in _MATMULS:
        return MATMUL
    if "norm" in stem or stem in _ELEMENTWISE or stem.startswith("_foreach_"):
        return ELEMENTWISE
    return None


def class_of(chain: Sequence[str]) -> str:
    """The class of an op from its names, itself first, then each range around it out to the root: the
    optimizer's wherever ``Optimizer.*`` encloses it, else the nearest classified name's, else ``other ops``."""
    classes = [classify_op(n) for n in chain]
    if OPTIMIZER in classes:
        return OPTIMIZER
    return next((c for c in classes if c is not None), OTHER)


def seconds_by_class(events: Iterable, wall_s: float) -> dict[str, float]:
    """A profiled step's time per class: each CPU event's self time (``torch.profiler``'s FunctionEvents, with
    ``cpu_parent``) under :func:`class_of` its chain of names, and what the step's ``wall_s`` left outside any
    op as :data:`OUTSIDE` (never below 0), so the classes add up to the step."""
    out = dict.fromkeys(CLASSES, 0.0)
    for ev in events:
        chain, parent = [ev.name], ev.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        out[class_of(chain)] += ev.self_cpu_time_total / 1e6
    out[OUTSIDE] = max(0.0, wall_s - sum(out.values()))
    return out


def flops_by_class(flop_counts: Mapping[object, int]) -> dict[str, int]:
    """FLOPs per class from ``FlopCounterMode.get_flop_counts()["Global"]`` (op → FLOPs); FLOPs of an op no class
    claims go to ``other ops``."""
    out = dict.fromkeys(CLASSES, 0)
    for op, flops in flop_counts.items():
        out[classify_op(str(op)) or OTHER] += int(flops)
    return out


def class_rows(seconds: Mapping[str, float], tflop: Mapping[str, float], peak_tflops: float) -> list[dict]:
    """One row per class: seconds, share of the step, TFLOP, TFLOP/s and the share of ``peak_tflops`` (matmul-like
    classes only; None for the others and for classes that took no time)."""
    total = sum(seconds.values())
    rows = []
    for name in CLASSES:
        s, t = seconds.get(name, 0.0), tflop.get(name, 0.0)
        rate = t / s if name in MATMUL_LIKE and s > 0 else None
        rows.append(
            {
                "class": name,
                "seconds": s,
                "of_step": s / total if total else 0.0,
                "tflop": t,
                "tflops": rate,
                "of_peak": rate / peak_tflops if rate is not None else None,
            }
        )
    return rows


def format_profile(variant: str, rows: list[dict], wall_s: float, peak_tflops: float, dtype: str) -> str:
    """The per-class table of one variant's profiled step."""
    lines = [
        f"{variant}: one profiled step {wall_s:.2f} s (profiler on); share of the {dtype} matmul peak "
        f"{peak_tflops:.3f} TFLOP/s for matmul-like classes, time only for memory-bound ones",
        f"  {'class':<22}{'s':>8}{'of step':>9}{'TFLOP':>9}{'TFLOP/s':>9}{'of peak':>9}",
    ]
    for r in rows:
        rate = f"{r['tflops']:>9.3g}" if r["tflops"] is not None else f"{'-':>9}"
        share = f"{r['of_peak']:>9.1%}" if r["of_peak"] is not None else f"{'-':>9}"
        tflop = f"{r['tflop']:>9.3g}" if r["class"] in MATMUL_LIKE else f"{'-':>9}"
        lines.append(f"  {r['class']:<22}{r['seconds']:>8.3f}{r['of_step']:>9.1%}{tflop}{rate}{share}")
    return "\n".join(lines)
